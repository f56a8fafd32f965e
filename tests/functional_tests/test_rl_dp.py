"""Data parallel: torchrun on 2 GPUs, same recipe, BI parity 0 with both ranks' tokens counted."""

import pytest
import torch

from .conftest import read_metrics, run_pretrain_rl

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (nvidia-h200-x2)")
def test_two_ranks_keep_parity(tmp_path):
    jsonl = tmp_path / "m.jsonl"
    run_pretrain_rl("--batch-invariant-mode", "--flash-attention-version", "4",
                    "--train-iters", "5", "--rl-metrics-jsonl", str(jsonl), nproc=2)
    metrics = read_metrics(jsonl)
    assert sorted(metrics) == [1, 2, 3, 4, 5]
    for record in metrics.values():
        assert record["bit_wise/logprob_diff/max"] == 0.0
        assert record["bit_wise/ratio_tokens_different"] == 0.0
        assert record["rollouts/groups"] == 2 * 4  # both ranks' groups
