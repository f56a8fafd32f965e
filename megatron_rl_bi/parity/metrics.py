"""Trainer-vs-engine logprob comparison: the `bit_wise/*` metrics.

Compared in the trainer's logprob dtype (fp32 from `bi.selective_log_softmax`, so stricter than
a bf16 comparison): the engine's logprobs are cast to it, and only positions the engine actually
reported count. Equal values (including matching infinities) count as equal; a NaN on either side
counts as different. `parity_terms` are one process's sums, which pool over data-parallel ranks
(`distributed.all_reduce_metrics`); `parity_metrics` are the metrics of one process's tokens.
"""

import math

import torch

from megatron_rl_bi.distributed import MetricTerms

MEAN = "bit_wise/logprob_diff/mean"
ABS_MEAN = "bit_wise/logprob_diff/abs_mean"
MAX = "bit_wise/logprob_diff/max"
RATIO_DIFFERENT = "bit_wise/ratio_tokens_different"
TOKENS = "bit_wise/tokens"


def parity_terms(
    train_logprobs: torch.Tensor, engine_logprobs: torch.Tensor, reported_mask: torch.Tensor
) -> MetricTerms:
    """train_logprobs, engine_logprobs, reported_mask: same shape (e.g. [T] packed).

    Mean (signed, trainer minus engine), abs_mean and max (of |diff|) over reported positions,
    the fraction of reported tokens whose bits differ, and the count compared. With no reported
    position the diffs are NaN: a parity of 0 over 0 tokens proves nothing.
    """
    if not (train_logprobs.shape == engine_logprobs.shape == reported_mask.shape):
        raise ValueError(
            "parity_metrics needs equal shapes, got "
            f"{tuple(train_logprobs.shape)}, {tuple(engine_logprobs.shape)}, "
            f"{tuple(reported_mask.shape)}"
        )
    # On the CPU: a few reductions, and out of reach of the BI aten overrides (CUDA-only).
    mask = reported_mask.detach().cpu().bool()
    train = train_logprobs.detach().cpu()[mask]
    engine = engine_logprobs.detach().cpu().to(train.dtype)[mask]
    tokens = int(mask.sum())
    same = train == engine
    diff = torch.where(same, torch.zeros_like(train), train - engine).double()
    abs_diff = torch.where(same, torch.zeros_like(diff), diff.abs().nan_to_num(nan=math.inf))
    return MetricTerms(
        means={MEAN: (diff.sum().item(), tokens), ABS_MEAN: (abs_diff.sum().item(), tokens),
               RATIO_DIFFERENT: ((~same).sum().item(), tokens)},
        sums={TOKENS: tokens},
        maxima={MAX: abs_diff.max().item() if tokens else -math.inf},
    )


def parity_metrics(
    train_logprobs: torch.Tensor, engine_logprobs: torch.Tensor, reported_mask: torch.Tensor
) -> dict[str, float]:
    """`parity_terms` of one process, as metrics."""
    return parity_terms(train_logprobs, engine_logprobs, reported_mask).finalize()
