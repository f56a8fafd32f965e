"""--rl-samples-jsonl FILE: what the policy wrote, a few rollouts a step, beside the metrics: a
reward that falls says how much, the samples say why (a redirect dropped, a tag misspelled).

Each line is one rollout of rank 0's first `per_step` of the step: the step, its group, reward
and advantage, the prompt's text, and the completion as its segments in order, each the model's
(sampled, what the loss trains) or the environment's (an observation, not trained on).
"""

import itertools
import json
import os


def completion_segments(tokens: list[int], sampled: list[bool] | None, decode) -> list[dict]:
    """[{"model": text} | {"environment": text}, ...]: runs of sampled and of environment tokens,
    each decoded whole (`sampled` None: every token is the model's)."""
    if sampled is None:
        sampled = [True] * len(tokens)
    return [{"model" if by_model else "environment": decode([token for token, _ in run])}
            for by_model, run in itertools.groupby(zip(tokens, sampled), key=lambda pair: pair[1])]


def sample_record(step: int, rollout, decode) -> dict:
    generation = rollout.generation
    return {"step": step, "group": rollout.group_id, "reward": rollout.reward, "advantage": rollout.advantage,
            "prompt": decode(generation.prompt_tokens),
            "completion": completion_segments(generation.completion_tokens, generation.completion_sampled, decode)}


class SampleWriter:
    """Appends `per_step` rollouts a step to `path` (a resumed run goes on in the same file)."""

    def __init__(self, path: str, per_step: int, decode):
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self.per_step, self.decode = per_step, decode
        self._file = open(path, "a", buffering=1, encoding="utf-8")

    def write(self, step: int, rollouts: list) -> None:
        for rollout in rollouts[:self.per_step]:
            self._file.write(json.dumps(sample_record(step, rollout, self.decode)) + "\n")

    def close(self) -> None:
        self._file.close()
