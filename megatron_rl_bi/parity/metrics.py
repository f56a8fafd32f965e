"""Trainer-vs-engine comparison: logprobs (the `bit_wise/*` metrics) and, for MoE models under
--moe-enable-routing-replay, the experts each token was routed to (`routing/*`).

Compared in the trainer's logprob dtype (fp32 from `bi.selective_log_softmax`, so stricter than
a bf16 comparison): the engine's logprobs are cast to it, and only positions the engine actually
reported count. Equal values (including matching infinities) count as equal; a NaN on either side
counts as different. `parity_terms` are one process's sums, which pool over data-parallel ranks
(`distributed.all_reduce_metrics`); `parity_metrics` are the metrics of one process's tokens.
"""

import math

import torch

from megatron_rl_bi.distributed import MetricTerms
from megatron_rl_bi.models.moe import recorded_routing

MEAN = "bit_wise/logprob_diff/mean"
ABS_MEAN = "bit_wise/logprob_diff/abs_mean"
MAX = "bit_wise/logprob_diff/max"
RATIO_DIFFERENT = "bit_wise/ratio_tokens_different"
TOKENS = "bit_wise/tokens"
ROUTING_TOKENS = "routing/tokens"
ROUTING_TOKENS_DIFFERENT = "routing/ratio_tokens_different"
ROUTING_DIFFERENT = "routing/ratio_different"


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


def routing_terms(train_routing: torch.Tensor, engine_routing: torch.Tensor, routed: torch.Tensor) -> MetricTerms:
    """train_routing, engine_routing: [T, MoE layers, k] expert indices; routed: [T] bool, the
    tokens compared. A token's routing differs in a layer when its set of k experts does (the
    order the k come in is not compared). The fraction of tokens that differ in any layer, of
    (token, layer) pairs that differ, and of tokens in each layer (`routing/layer_<i>/...`, the
    i-th MoE layer from 0), and the count compared."""
    if not (train_routing.shape == engine_routing.shape and train_routing.shape[:1] == routed.shape):
        raise ValueError("routing_terms needs routing of equal shapes [T, layers, k] and a [T] mask, got "
                         f"{tuple(train_routing.shape)}, {tuple(engine_routing.shape)}, {tuple(routed.shape)}")
    mask = routed.detach().cpu().bool()
    train, engine = (r.detach().cpu()[mask].sort(dim=-1).values for r in (train_routing, engine_routing))
    differs = (train != engine).any(dim=-1)  # [tokens, layers]
    tokens, layers = differs.shape
    means = {ROUTING_TOKENS_DIFFERENT: (differs.any(dim=1).sum().item(), tokens),
             ROUTING_DIFFERENT: (differs.sum().item(), tokens * layers)}
    means.update({f"routing/layer_{i}/ratio_different": (differs[:, i].sum().item(), tokens) for i in range(layers)})
    return MetricTerms(means=means, sums={ROUTING_TOKENS: tokens})


class RoutingCompared:
    """The trainer's routing (recorded by the forward just run) beside the engine's, collected
    over micro-batches and compared once; nothing when the engine recorded none."""

    def __init__(self):
        self.train, self.engine, self.routed = [], [], []

    def add(self, packed) -> None:
        """`packed`: the PackedCompletions of the forward just run."""
        if packed.engine_routing is None:
            return
        train = recorded_routing()
        if train is None:
            raise RuntimeError("the engine recorded routing but the trainer's forward did not "
                               "(--moe-enable-routing-replay: one model records)")
        self.train.append(train.detach())
        self.engine.append(packed.engine_routing)
        self.routed.append(packed.routed)

    def tensors(self) -> dict[str, torch.Tensor]:
        """{"train_routing", "engine_routing", "routed"} on the CPU, or {} when none was added."""
        if not self.train:
            return {}
        return {name: torch.cat(part).cpu() for name, part in
                (("train_routing", self.train), ("engine_routing", self.engine), ("routed", self.routed))}

    def terms(self) -> MetricTerms:
        compared = self.tensors()
        return routing_terms(**compared) if compared else MetricTerms()
