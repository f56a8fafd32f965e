"""Rewards: run the verifier safely, DAPO's overlong shaping, and dynamic-sampling group filter."""

import logging
import math

import torch

logger = logging.getLogger(__name__)


# What went wrong with a reward, if anything; each scores 0 and is counted.
RAISED, NONFINITE = "raised", "nonfinite"


def score_completion(example, generation, tokenizer) -> tuple[float, str | None]:
    """(reward, problem) of one generation for `example`: its completion decoded without the
    end-of-document token, through the example's verifier (`safe_reward`)."""
    completion = generation.completion_tokens
    text_tokens = completion[:-1] if generation.stopped_on_eod else completion
    return safe_reward(example.verify, tokenizer.decode(text_tokens))


def safe_reward(verify, completion: str) -> tuple[float, str | None]:
    """(reward, problem). A verifier that raises, or returns something that is not a number
    (text included, though float() would read "1"), scores 0 with problem RAISED; a NaN or
    infinite reward scores 0 with problem NONFINITE. Neither is fatal, and no non-finite value
    reaches the advantages."""
    try:
        value = verify(completion)
        if isinstance(value, (str, bytes)):
            raise TypeError(f"returned the text {value!r}, not a number")
        reward = float(value)
    except Exception as exc:  # noqa: BLE001 - any verifier bug must not kill the run
        logger.warning("verifier raised %s: %s (reward 0)", type(exc).__name__, exc)
        return 0.0, RAISED
    if not math.isfinite(reward):
        logger.warning("verifier returned %s (reward 0)", reward)
        return 0.0, NONFINITE
    return reward, None


def overlong_penalty(
    lengths: torch.Tensor, max_length, buffer_length: int, penalty: float = 1.0
) -> torch.Tensor:
    """DAPO's soft overlong punishment, added to the task reward.

    0 for length <= max_length - buffer_length; then falls linearly to -penalty at max_length
    (and stays there beyond). Example, max 20, buffer 4: lengths 16 -> 0, 18 -> -0.5, 20 -> -1.
    `max_length` may be one budget or one per length (the budgets the engine ran with); a budget
    shorter than the buffer shapes over the whole budget.
    """
    if buffer_length <= 0:
        raise ValueError(f"overlong buffer {buffer_length} must be > 0")
    max_length = torch.as_tensor(max_length, dtype=torch.float32)
    if (max_length <= 0).any():
        raise ValueError(f"overlong shaping needs budgets > 0, got {max_length.tolist()}")
    buffer = torch.clamp(max_length, max=buffer_length)
    excess = (lengths.float() - (max_length - buffer)).clamp(min=0)
    return -penalty * (excess / buffer).clamp(max=1.0)


def groups_with_signal(rewards: torch.Tensor) -> torch.Tensor:
    """DAPO dynamic sampling: [num_groups, group_size] -> bool [num_groups], False where every
    completion of the group got the same reward (zero advantage, no gradient)."""
    return (rewards != rewards[:, :1]).any(dim=1)
