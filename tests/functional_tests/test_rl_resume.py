"""Resume: a BI run stopped at step 3 and resumed from its checkpoint repeats the uninterrupted
run's metrics exactly for steps 4..8 (GPU)."""

import pytest

from .conftest import read_metrics, run_pretrain_rl

pytestmark = pytest.mark.gpu

BI = ["--batch-invariant-mode", "--flash-attention-version", "4"]
TIMING = ("time/", "throughput/")


def test_resumed_run_repeats_the_uninterrupted_one(tmp_path):
    full, part = tmp_path / "full", tmp_path / "part"
    run_pretrain_rl(*BI, "--train-iters", "8", "--save", str(full / "ckpt"),
                    "--rl-metrics-jsonl", str(full / "m.jsonl"))
    run_pretrain_rl(*BI, "--train-iters", "8", "--exit-interval", "3", "--save", str(part / "ckpt"),
                    "--rl-metrics-jsonl", str(part / "m.jsonl"))
    run_pretrain_rl(*BI, "--train-iters", "8", "--save", str(part / "ckpt"),
                    "--load", str(part / "ckpt"), "--rl-metrics-jsonl", str(part / "m.jsonl"))
    uninterrupted, resumed = read_metrics(full / "m.jsonl"), read_metrics(part / "m.jsonl")
    assert sorted(resumed) == list(range(1, 9))
    for step in range(4, 9):
        a = {k: v for k, v in uninterrupted[step].items() if not k.startswith(TIMING)}
        b = {k: v for k, v in resumed[step].items() if not k.startswith(TIMING)}
        assert a == b, f"step {step} differs after resume"
        assert a["bit_wise/logprob_diff/max"] == 0.0
