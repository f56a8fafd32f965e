"""Mixture-of-experts layers: megatron-core's MoELayer, batch-invariant under the switch.

megatron-core's layer is kept whole (its TopKRouter with z-loss and load-balancing losses, the
allgather token dispatcher at expert parallelism 1, SequentialMLP experts, shared experts). With
the switch on, two of its steps change, since they are where a token's bits could depend on the
rest of the batch or on the run:
- top-k: which of several equal scores torch.topk keeps, and in what order it returns the k (sorted
  only while autograd records, so the engine's come unsorted and a softmax over them adds in
  another order), are not fixed. Here top-k is a stable descending sort cut at k: the k largest,
  equal scores by lowest expert index, in one order with or without autograd.
- permutation and combine: index_select's backward and scatter_add add into a token's row with
  atomics, in an order that changes from run to run. Here a token's k expert outputs are gathered
  and added in ascending expert order in fp32, forward and backward, with no atomics.
The rest is row-wise already: the router GEMM and every expert's GEMMs run through the BI GEMM
(each row's bits the same for any number of rows an expert receives), the score function is a
softmax or sigmoid per token, and the experts scale by the router's probabilities row by row.
Without autograd (the engine) the experts run at once, their GEMMs grouped in one launch of the
same bits (`BatchInvariantExperts`), since one expert after another is host-bound at 128 experts.
"""

from dataclasses import dataclass
from functools import partial
from types import SimpleNamespace

import torch
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.moe.experts import SequentialMLP
from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules
from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker
from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler, get_default_pg_collection
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction
from megatron.core.transformer.moe.shared_experts import SharedExpertMLP
from megatron.core.transformer.moe.token_dispatcher import MoEAllGatherTokenDispatcher
from torch.overrides import TorchFunctionMode

from megatron_rl_bi import bi
from megatron_rl_bi.bi import grouped_gemm


def stable_topk(scores: torch.Tensor, k: int, dim: int = -1, largest: bool = True,
                sorted: bool = True) -> torch.return_types.topk:
    """torch.topk's result, fixed: the k largest (smallest) along `dim`, largest first, equal
    values by lowest index. `sorted` is accepted and ignored: the order is always the same."""
    values, indices = torch.sort(scores, dim=dim, descending=largest, stable=True)
    return torch.return_types.topk((values.narrow(dim, 0, k), indices.narrow(dim, 0, k)))


class _StableTopK(TorchFunctionMode):
    """Runs torch.topk (function or method) as `stable_topk` inside the block."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.topk or func is torch.Tensor.topk:
            return stable_topk(*args, **(kwargs or {}))
        return func(*args, **(kwargs or {}))


class BatchInvariantRouter(TopKRouter):
    """megatron-core's TopKRouter; under the switch its top-k is `stable_topk`."""

    def routing(self, logits: torch.Tensor, padding_mask: torch.Tensor | None = None):
        if not bi.enabled():
            return super().routing(logits, padding_mask)
        with _StableTopK():
            return super().routing(logits, padding_mask)


@dataclass(frozen=True)
class ExpertSlots:
    """Where each token's rows go in the expert-major order the experts take.

    `token_of_row[r]`: the token of permuted row r (rows grouped by expert, ascending, tokens in
    order within an expert); `rows_of_token[t, j]`: the row of token t's j-th expert (ascending)."""

    token_of_row: torch.Tensor  # [T * k] int64
    rows_of_token: torch.Tensor  # [T, k] int64
    expert_major: torch.Tensor  # [T * k] int64: the rows' flat indices into a [E, T] map


def expert_slots(routing_map: torch.Tensor, topk: int) -> ExpertSlots:
    """routing_map [T, E] bool with exactly `topk` experts a token (no token is dropped)."""
    num_tokens, num_experts = routing_map.shape
    by_expert = routing_map.T.reshape(-1)  # [E * T]: expert e's tokens at e*T .. e*T+T-1
    order = torch.argsort(by_expert.to(torch.int8), descending=True, stable=True)
    expert_major = order[: num_tokens * topk]
    row_of_entry = torch.empty_like(order)
    row_of_entry[order] = torch.arange(order.numel(), device=order.device)
    experts = stable_topk(routing_map.to(torch.int8), topk).indices  # [T, k], ascending
    tokens = torch.arange(num_tokens, device=order.device).unsqueeze(1)
    rows_of_token = row_of_entry[experts * num_tokens + tokens]
    return ExpertSlots(expert_major % num_tokens, rows_of_token, expert_major)


def _sum_rows(rows: torch.Tensor, rows_of_token: torch.Tensor) -> torch.Tensor:
    """out[t] = rows[rows_of_token[t, 0]] + rows[rows_of_token[t, 1]] + ..., added in that order
    in fp32 and rounded once to rows' dtype."""
    total = rows.index_select(0, rows_of_token[:, 0]).float()
    for j in range(1, rows_of_token.shape[1]):
        total = total + rows.index_select(0, rows_of_token[:, j]).float()
    return total.to(rows.dtype)


class _Permute(torch.autograd.Function):
    """tokens [T, H] -> rows [T * k, H] in expert-major order; the backward adds each token's k
    row gradients in a fixed order (index_select's own backward adds them with atomics)."""

    @staticmethod
    def forward(ctx, tokens, token_of_row, rows_of_token):
        ctx.save_for_backward(rows_of_token)
        return tokens.index_select(0, token_of_row)

    @staticmethod
    def backward(ctx, grad_rows):
        (rows_of_token,) = ctx.saved_tensors
        return _sum_rows(grad_rows, rows_of_token), None, None


class _Combine(torch.autograd.Function):
    """rows [T * k, H] -> tokens [T, H], each token the sum of its k rows in ascending expert order;
    the backward is a gather (each row belongs to one token)."""

    @staticmethod
    def forward(ctx, rows, token_of_row, rows_of_token):
        ctx.save_for_backward(token_of_row)
        return _sum_rows(rows, rows_of_token)

    @staticmethod
    def backward(ctx, grad_tokens):
        (token_of_row,) = ctx.saved_tensors
        return grad_tokens.index_select(0, token_of_row), None, None


class BatchInvariantDispatcher(MoEAllGatherTokenDispatcher):
    """megatron-core's allgather dispatcher (expert parallelism 1: no communication); under the
    switch its permutation and combine are `_Permute` and `_Combine`."""

    def dispatch_postprocess(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        if not bi.enabled():
            return super().dispatch_postprocess(hidden_states, probs)
        self.hidden_shape_before_permute = hidden_states.shape
        self.slots = expert_slots(self.routing_map, self.router_topk)
        tokens_per_expert = self.routing_map.sum(dim=0).long()  # on the device: no host sync here
        rows = _Permute.apply(hidden_states, self.slots.token_of_row, self.slots.rows_of_token)
        row_probs = probs.T.reshape(-1).index_select(0, self.slots.expert_major)
        self.routing_map = None
        return rows, tokens_per_expert, row_probs

    def combine_preprocess(self, hidden_states: torch.Tensor):
        if not bi.enabled():
            return super().combine_preprocess(hidden_states)
        return _Combine.apply(hidden_states, self.slots.token_of_row, self.slots.rows_of_token)


class _GroupedLinear(torch.nn.Module):
    """Every expert's linear at once (one of megatron-core's MLP linears: returns (out, bias))."""

    def __init__(self, table: torch.Tensor, shape: torch.Size, rows_per_expert: torch.Tensor):
        super().__init__()
        self.table, self.shape, self.rows_per_expert = table, shape, rows_per_expert

    def forward(self, rows: torch.Tensor):
        return grouped_gemm.grouped_matmul(rows, self.table, self.shape, self.rows_per_expert), None


class BatchInvariantExperts(SequentialMLP):
    """megatron-core's SequentialMLP. Under the switch and without autograd (the engine; also the
    trainer's forwards that record nothing), its experts run at once: megatron-core's MLP.forward
    over every expert's rows, its two linears `grouped_gemm.grouped_matmul`, whose rows are the
    BI GEMM's bits (tests/gpu/test_moe.py holds the two paths equal). With autograd each expert
    runs alone, as megatron-core does, and its linears' backward gives each expert's gradients."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._tables = (grouped_gemm.WeightTable(), grouped_gemm.WeightTable())
        self._groupable: dict[tuple[torch.dtype, torch.device], bool] = {}

    def _linear_weights(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        return ([expert.linear_fc1.weight for expert in self.local_experts],
                [expert.linear_fc2.weight for expert in self.local_experts])

    def _weights_groupable(self, dtype: torch.dtype, device: torch.device) -> bool:
        """Asked once per dtype and device: a step's hundreds of calls would each check every
        expert's two weights on the host."""
        if (dtype, device) not in self._groupable:
            fc1, fc2 = self._linear_weights()
            self._groupable[dtype, device] = (
                fc2[0].shape[1] * (2 if self.config.gated_linear_unit else 1) == fc1[0].shape[0]
                and all(grouped_gemm.groupable(w, dtype, device) for w in (fc1, fc2)))
        return self._groupable[dtype, device]

    def _grouped(self, rows: torch.Tensor) -> bool:
        if (not bi.enabled("gemm") or torch.is_grad_enabled() or self.num_local_experts == 1
                or self.config.fp8 or self.config.fp4 or self.config.moe_apply_probs_on_input
                or self.config.add_bias_linear or rows.dim() != 2):
            return False
        return (rows.shape[1] == self.local_experts[0].linear_fc1.weight.shape[1]
                and self._weights_groupable(rows.dtype, rows.device))

    def forward(self, rows: torch.Tensor, tokens_per_expert: torch.Tensor, probs: torch.Tensor):
        if not self._grouped(rows):
            return super().forward(rows, tokens_per_expert, probs)
        expert, rows_per_expert = self.local_experts[0], tokens_per_expert.to(rows.device)
        linears = [_GroupedLinear(table(weights), weights[0].shape, rows_per_expert)
                   for table, weights in zip(self._tables, self._linear_weights())]
        # megatron-core's own expert forward, its activation and scaling the same code on all rows
        every_expert = SimpleNamespace(config=expert.config, activation_func=expert.activation_func,
                                       linear_fc1=linears[0], linear_fc2=linears[1])
        return MLP.forward(every_expert, rows, per_token_scale=probs)


class BatchInvariantMoELayer(MoELayer):
    """megatron-core's MoELayer with `BatchInvariantDispatcher` as its token dispatcher."""

    def __init__(self, config, submodules=None, layer_number=None, pg_collection=None,
                 is_mtp_layer=False, name=None):
        pg_collection = pg_collection or get_default_pg_collection()
        super().__init__(config, submodules, layer_number, pg_collection, is_mtp_layer, name)
        self.token_dispatcher = BatchInvariantDispatcher(
            self.num_local_experts, self.local_expert_indices, config=self.config,
            pg_collection=pg_collection,
        )


def scale_router_losses(global_tokens: torch.Tensor) -> None:
    """Scales the MoE layers' load-balancing and z-loss gradients for an optimizer step over
    `global_tokens` tokens (a 0-dim tensor of every rank's and micro-batch's: set on the device,
    without waiting for it). Under --calculate-per-token-loss
    megatron-core multiplies each micro-batch's router losses by its token count and leaves the
    division to finalize_model_grads, which divides every gradient by the step's token count.
    Here the RL and SFT losses are normalized already and gradients are not divided, so the
    router losses take that division alone: a token-weighted mean over the micro-batches."""
    MoEAuxLossAutoScaler.set_loss_scale(1.0 / global_tokens.float().clamp(min=1.0))


def router_loss_sums() -> dict[str, float]:
    """The router losses megatron-core's tracker summed since the last call (each micro-batch's
    forward adds its own), averaged over the MoE layers, as moe/<name> (load_balancing_loss,
    z_loss, ... without their coefficients); the tracker is cleared."""
    tracker = get_moe_metrics_tracker()
    sums = {f"moe/{name}": float(entry.values[entry.values != 0].mean())
            for name, entry in tracker.metrics.items() if entry.values.any()}
    tracker.clear()
    return sums


def start_recording_routing() -> None:
    """Every router built with --moe-enable-routing-replay records the experts it chooses at each
    forward, the engine's and the trainer's (megatron-core's RouterReplay; its routers are listed
    process-wide, so one model records: `forget_routing_recorders` before building it)."""
    RouterReplay.set_global_router_replay_action(RouterReplayAction.RECORD)


def forget_routing_recorders() -> None:
    """Drops the routers of models built before (a model built next records alone)."""
    RouterReplay.clear_global_router_replay_instances()


def recorded_routing() -> torch.Tensor | None:
    """The experts each MoE layer's router chose in the last forward, [tokens, MoE layers, k]
    in layer order, or None when a layer recorded nothing; the records are cleared."""
    recorded = RouterReplay.get_recorded_data()
    RouterReplay.clear_global_indices()
    if not recorded or any(indices is None for indices in recorded):
        return None
    return torch.stack(recorded, dim=1)


def moe_mlp(linear_fc1: type, linear_fc2: type):
    """The MLP builder of a MoE layer (a layer spec's `mlp`): routed SequentialMLP experts and
    shared experts (built when --moe-shared-expert-intermediate-size is set), of these linears."""
    linears = MLPSubmodules(linear_fc1=linear_fc1, linear_fc2=linear_fc2)
    experts = partial(BatchInvariantExperts, submodules=linears)
    return partial(BatchInvariantMoELayer, submodules=MoESubmodules(
        experts=experts, shared_experts=partial(SharedExpertMLP, submodules=linears),
        router=BatchInvariantRouter))
