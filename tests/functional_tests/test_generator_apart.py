"""Generator ranks apart (--rl-generator-ranks 1) on the GPU: a trainer and a generator process
(on one GPU, or on two when there are two). At --rl-generation-lag 0 the generator samples batch s
with the weights the trainer had after step s - 1, as the colocated loop does, so the main job
must repeat its published bits (results/rl_tiny_h200.jsonl) in every non-timing value: BI parity
across processes. At lag 2 the run must equal a colocated run with the same lag (the window's
bookkeeping), with parity 0 on the fresh samples and on the version-matched recomputes."""

import os
import subprocess
import sys

import pytest
import torch

from megatron_rl_bi.reporting.metrics import read_step_records

from .conftest import REPO, TINY_RECIPE
from .test_memory_levers import compare_metrics

pytestmark = pytest.mark.gpu

STEPS = 20
LAG = ["--rl-partial-rollouts", "--rl-generation-lag", "2", "--rl-keep-old-weights", "3"]


def _main_job(tmp_path, name: str, flags: list[str], nproc: int = 1) -> dict[int, dict]:
    metrics = tmp_path / f"{name}.jsonl"
    subprocess.run([sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
                    os.path.join(REPO, "pretrain_rl.py"), "--recipe", TINY_RECIPE, "--batch-invariant-mode",
                    "--flash-attention-version", "4", "--train-iters", str(STEPS), "--rl-metrics-jsonl", str(metrics),
                    "--save", str(tmp_path / f"{name}_ckpt"), *flags], check=True, cwd=REPO)
    return read_step_records(str(metrics))


def test_lag_0_apart_repeats_the_published_main_job(tmp_path):
    published = read_step_records(os.path.join(REPO, "results", "rl_tiny_h200.jsonl"))
    records = _main_job(tmp_path, "apart", ["--rl-generator-ranks", "1"], nproc=2)
    assert compare_metrics.differences({s: published[s] for s in range(1, STEPS + 1)}, records) == []


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="the nccl refit needs each process on its own GPU "
                                                          "(nvidia-h200-x2)")
def test_lag_0_apart_over_nccl_on_two_gpus_repeats_the_published_main_job(tmp_path):
    published = read_step_records(os.path.join(REPO, "results", "rl_tiny_h200.jsonl"))
    records = _main_job(tmp_path, "nccl", ["--rl-generator-ranks", "1", "--refit-method", "nccl"], nproc=2)
    assert compare_metrics.differences({s: published[s] for s in range(1, STEPS + 1)}, records) == []


def test_lag_2_apart_repeats_the_colocated_window(tmp_path):
    colocated = _main_job(tmp_path, "colocated", LAG)
    apart = _main_job(tmp_path, "apart", LAG + ["--rl-generator-ranks", "1"], nproc=2)
    assert compare_metrics.differences(colocated, apart) == []
    assert any(record.get("bit_wise_versioned/tokens") for record in apart.values())
    for record in apart.values():  # a pool with no token has no maximum (NaN): only those with tokens
        for pool in ("bit_wise_fresh", "bit_wise_versioned"):
            if record.get(f"{pool}/tokens"):
                assert record[f"{pool}/logprob_diff/max"] == 0.0
