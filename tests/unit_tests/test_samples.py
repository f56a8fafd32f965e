"""--rl-samples-jsonl (reporting/samples.py), CPU: a rollout's completion split into the model's
and the environment's segments by hand, and the records a step writes."""

import json
from types import SimpleNamespace

from megatron_rl_bi.reporting.metrics import MetricsLogger
from megatron_rl_bi.reporting.samples import SampleWriter, completion_segments


def decode(ids):
    return "".join(chr(ord("a") + i) for i in ids)


def test_segments_follow_the_sampled_mask_in_order():
    segments = completion_segments([0, 1, 2, 3, 4, 5], [True, True, False, False, False, True], decode)
    assert segments == [{"model": "ab"}, {"environment": "cde"}, {"model": "f"}]
    assert completion_segments([7, 8], None, decode) == [{"model": "hi"}]
    assert completion_segments([], None, decode) == []
    assert completion_segments([0], [False], decode) == [{"environment": "a"}]


def rollout(group, reward, completion, sampled):
    generation = SimpleNamespace(prompt_tokens=[25], completion_tokens=completion, completion_sampled=sampled)
    return SimpleNamespace(generation=generation, group_id=group, reward=reward, advantage=reward - 0.5)


def test_a_step_writes_its_first_rollouts_through_the_metrics_logger(tmp_path):
    path = tmp_path / "samples.jsonl"
    logger = MetricsLogger(total_steps=2, samples=SampleWriter(str(path), 2, decode))
    rollouts = [rollout(0, 1.0, [1, 2], [True, False]), rollout(0, 0.0, [3], None), rollout(1, 1.0, [4], None)]
    logger.log(1, {}, rollouts)
    logger.log(2, {}, rollouts[2:])
    logger.close()
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert lines == [
        {"step": 1, "group": 0, "reward": 1.0, "advantage": 0.5, "prompt": "z",
         "completion": [{"model": "b"}, {"environment": "c"}]},
        {"step": 1, "group": 0, "reward": 0.0, "advantage": -0.5, "prompt": "z", "completion": [{"model": "d"}]},
        {"step": 2, "group": 1, "reward": 1.0, "advantage": 0.5, "prompt": "z", "completion": [{"model": "e"}]},
    ]
