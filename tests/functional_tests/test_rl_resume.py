"""Resume: a BI run stopped at step 3 and resumed from its checkpoint by a second process with
another --seed repeats the uninterrupted run's metrics exactly for steps 4..8 (GPU). The second
process must log step 4 first (a restart from step 1 would repeat steps 4..8 too, since BI runs
repeat bit for bit), and only the seed, prompt position and weights of the checkpoint can make
its steps equal the uninterrupted run's under another --seed."""

import pytest

from megatron_rl_bi.reporting.metrics import is_machine_measurement, read_segments

from .conftest import read_metrics, run_pretrain_rl

pytestmark = pytest.mark.gpu

BI = ["--batch-invariant-mode", "--flash-attention-version", "4"]


def test_resumed_run_repeats_the_uninterrupted_one(tmp_path):
    full, part = tmp_path / "full", tmp_path / "part"
    run_pretrain_rl(*BI, "--train-iters", "8", "--save", str(full / "ckpt"),
                    "--rl-metrics-jsonl", str(full / "m.jsonl"))
    run_pretrain_rl(*BI, "--train-iters", "8", "--exit-interval", "3", "--save", str(part / "ckpt"),
                    "--rl-metrics-jsonl", str(part / "m.jsonl"))
    run_pretrain_rl(*BI, "--train-iters", "8", "--save", str(part / "ckpt"), "--seed", "4321",
                    "--load", str(part / "ckpt"), "--rl-metrics-jsonl", str(part / "m.jsonl"))
    stopped, resumed = read_segments(str(part / "m.jsonl"))
    assert [r["step"] for r in stopped] == [1, 2, 3]
    assert [r["step"] for r in resumed] == [4, 5, 6, 7, 8]
    uninterrupted = read_metrics(full / "m.jsonl")
    for record in resumed:
        a = {k: v for k, v in uninterrupted[record["step"]].items() if not is_machine_measurement(k)}
        b = {k: v for k, v in record.items() if not is_machine_measurement(k)}
        assert a == b, f"step {record['step']} differs after resume"
        assert a["bit_wise/logprob_diff/max"] == 0.0
