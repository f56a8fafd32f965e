"""Rewards: run the verifier safely, DAPO's overlong shaping, and dynamic-sampling group filter."""

import logging

import torch

logger = logging.getLogger(__name__)


def score_completion(example, generation, tokenizer) -> tuple[float, bool]:
    """(reward, verifier_failed) of one generation for `example`: its completion decoded without
    the end-of-document token, through the example's verifier (`safe_reward`)."""
    completion = generation.completion_tokens
    text_tokens = completion[:-1] if generation.stopped_on_eod else completion
    return safe_reward(example.verify, tokenizer.decode(text_tokens))


def safe_reward(verify, completion: str) -> tuple[float, bool]:
    """(reward, verifier_failed). A verifier that raises scores 0 and is counted, never fatal."""
    try:
        return float(verify(completion)), False
    except Exception as exc:  # noqa: BLE001 - any verifier bug must not kill the run
        logger.warning("verifier raised %s: %s (reward 0)", type(exc).__name__, exc)
        return 0.0, True


def overlong_penalty(
    lengths: torch.Tensor, max_length: int, buffer_length: int, penalty: float = 1.0
) -> torch.Tensor:
    """DAPO's soft overlong punishment, added to the task reward.

    0 for length <= max_length - buffer_length; then falls linearly to -penalty at max_length
    (and stays there beyond). Example, max 20, buffer 4: lengths 16 -> 0, 18 -> -0.5, 20 -> -1.
    """
    if not 0 < buffer_length <= max_length:
        raise ValueError(f"overlong buffer {buffer_length} must be in (0, {max_length}]")
    excess = (lengths.float() - (max_length - buffer_length)).clamp(min=0)
    return -penalty * (excess / buffer_length).clamp(max=1.0)


def groups_with_signal(rewards: torch.Tensor) -> torch.Tensor:
    """DAPO dynamic sampling: [num_groups, group_size] -> bool [num_groups], False where every
    completion of the group got the same reward (zero advantage, no gradient)."""
    return (rewards != rewards[:, :1]).any(dim=1)
