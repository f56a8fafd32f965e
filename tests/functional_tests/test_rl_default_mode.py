"""Default (non-BI) mode, same recipe, with truncated importance sampling: the parity metrics see
the engine/trainer mismatch and the TIS correction changes the loss (GPU).

The model is widened to the dense parity model's size (hidden 2048): at the tiny recipe's size
(and at hidden 512, measured) the stock kernels happen to give the engine's bits too, so there
would be nothing to see or correct. The wider model gets a longer, gentler SFT warm-up, and
overlong shaping over the whole completion budget, so that groups get unequal rewards (nonzero
advantages) even before the task is learned: with all-zero advantages the loss is 0 with or
without the correction."""

import pytest

from .conftest import read_metrics, run_pretrain_rl

pytestmark = pytest.mark.gpu

WIDE = ["--hidden-size", "2048", "--ffn-hidden-size", "5632", "--num-attention-heads", "16",
        "--num-query-groups", "4"]


def test_default_mode_sees_mismatch_and_tis_changes_the_loss(tmp_path):
    jsonl = tmp_path / "m.jsonl"
    run_pretrain_rl(*WIDE, "--flash-attention-version", "4", "--train-iters", "6",
                    "--rl-inference-logprobs-is-correction",
                    "--rl-importance-sampling-truncation-coef", "2.0",
                    "--rl-sft-warmup-steps", "60", "--rl-sft-lr", "3e-4",
                    "--rl-overlong-buffer", "12",
                    "--rl-metrics-jsonl", str(jsonl))
    metrics = read_metrics(jsonl)
    assert sorted(metrics) == list(range(1, 7))
    assert any(m["bit_wise/ratio_tokens_different"] > 0 for m in metrics.values())
    assert any(m["bit_wise/logprob_diff/abs_mean"] > 0 for m in metrics.values())
    assert any(m["loss"] != m["loss_without_tis"] for m in metrics.values())
    assert all(m["tis/weight_mean"] != 1.0 for m in metrics.values()
               if m["bit_wise/ratio_tokens_different"] > 0)
