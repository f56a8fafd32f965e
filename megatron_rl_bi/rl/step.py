"""One policy update from rollouts: pack -> trainer logprobs -> parity -> loss -> optimizer step.

Rollouts are split into `updates_per_step` mini-batches (one optimizer step each) and each
mini-batch into packed micro-batches of at most `micro_batch_tokens` tokens. The loss of a
mini-batch is normalized by its global (all data-parallel ranks) token or sequence count, so the
gradient does not depend on the micro-batch split. With more than one update, the trainer's
logprobs before the first update are the ratio's denominator ("old"); with one update the
ratio is 1 and only the advantage (and TIS weight) matter.
"""

import dataclasses
import time
from dataclasses import dataclass, field

import torch

from megatron_rl_bi.distributed import MetricTerms, all_reduce_metrics
from megatron_rl_bi.models.logprobs import forward_logprobs
from megatron_rl_bi.models.moe import router_loss_sums, scale_router_losses
from megatron_rl_bi.packing import (
    PackedCompletions,
    micro_batches,
    pack_completions,
    pack_token_values,
    unpack_token_values,
)
from megatron_rl_bi.parity import RoutingCompared, parity_terms
from megatron_rl_bi.rl.losses import LossConfig, LossInputs, policy_loss, token_weights
from megatron_rl_bi.rl.old_weights import KeptWeights
from megatron_rl_bi.rl.rollouts import Rollout


@dataclass(kw_only=True)
class StepConfig:
    loss: LossConfig = field(default_factory=LossConfig)
    aggregation: str = "token"
    """'token' (DAPO) or 'sequence' (GRPO) loss aggregation (--rl-loss-aggregation)."""
    micro_batch_tokens: int = 8192
    """Tokens per packed trainer forward (--rl-micro-batch-tokens)."""
    updates_per_step: int = 1
    """Optimizer steps per batch of rollouts (--grpo-iterations)."""
    temperature: float = 1.0
    """The engine's sampling temperature: trainer logprobs (and entropy) are of the same
    distribution (--rl-default-temperature)."""


class _Compared:
    """Trainer logprobs next to the engine's, collected over a step's micro-batches and compared
    once at the end (one device-to-host copy per step, not per micro-batch). With rollouts from
    older weights (generated ahead, --rl-generation-lag), fresh and stale ones are also compared
    apart (`bit_wise_fresh/*`, `bit_wise_stale/*`): in BI mode every difference is staleness."""

    def __init__(self, weight_version: int | None = None):
        self.weight_version = weight_version
        self.train, self.engine, self.reported, self.fresh = [], [], [], []
        self.routing = RoutingCompared()

    def add(self, logprobs: torch.Tensor, packed: PackedCompletions, rollouts: list[Rollout]) -> None:
        """Right after the forward that computed `logprobs` (the routing it recorded is read)."""
        self.train.append(logprobs.detach())
        self.engine.append(packed.engine_logprobs)
        self.reported.append(packed.reported)
        self.routing.add(packed)
        # On the CPU, where terms() compares: a device tensor here would cost a sync per micro-batch.
        fresh = torch.tensor([self.weight_version in (None, r.weight_version) for r in rollouts])
        self.fresh.append(fresh.repeat_interleave(torch.tensor([len(r.tokens) for r in rollouts])))

    def terms(self) -> MetricTerms:
        if not self.train:
            return parity_terms(torch.zeros(0), torch.zeros(0), torch.zeros(0, dtype=torch.bool))
        train, engine, reported, fresh = (torch.cat(part).cpu() for part in
                                          (self.train, self.engine, self.reported, self.fresh))
        terms = parity_terms(train, engine, reported).update(self.routing.terms())
        if not fresh.all():
            for prefix, subset in (("bit_wise_fresh/", fresh), ("bit_wise_stale/", ~fresh)):
                terms.update(_renamed(parity_terms(train, engine, reported & subset), prefix))
        return terms


def _renamed(terms: MetricTerms, prefix: str) -> MetricTerms:
    """`terms` with 'bit_wise/' in each name replaced by `prefix`."""
    def rename(table: dict) -> dict:
        return {prefix + name.removeprefix("bit_wise/"): value for name, value in table.items()}

    return MetricTerms(means=rename(terms.means), sums=rename(terms.sums), maxima=rename(terms.maxima))


def _pack(rollouts: list[Rollout]) -> tuple[PackedCompletions, torch.Tensor]:
    """The packed micro-batch on this GPU and each position's advantage [T] (that of its
    completion; 0 at positions that predict nothing)."""
    packed = pack_completions([r.generation for r in rollouts], torch.cuda.current_device())
    batch = packed.batch
    per_sequence = torch.tensor([r.advantage for r in rollouts], device=batch.has_target.device)
    advantages = torch.where(batch.has_target, per_sequence[batch.sequence_ids], 0.0)
    return packed, advantages


@torch.no_grad()
def _versioned_terms(ddp, rollouts: list[Rollout], kept: KeptWeights, weight_version: int,
                     config: StepConfig) -> MetricTerms:
    """The stale rollouts whose weights are still kept, recomputed under those weights: their
    parity as `bit_wise_versioned/*` (0 in BI mode: staleness explains every other difference)."""
    stale = [r for r in rollouts if r.weight_version != weight_version and r.weight_version in kept.versions]
    if not stale:
        return MetricTerms()
    compared = _Compared()
    for version in sorted({r.weight_version for r in stale}):
        with kept.swapped_in(ddp, version):
            for micro in micro_batches([r for r in stale if r.weight_version == version], config.micro_batch_tokens):
                packed, _ = _pack(micro)
                logprobs, _ = forward_logprobs(ddp, packed.batch, temperature=config.temperature)
                compared.add(logprobs, packed, micro)
    return _renamed(compared.terms(), "bit_wise_versioned/")


def _global_counts(minibatches: list[list[Rollout]], micro_batch_tokens: int) -> torch.Tensor:
    """[updates, 4]: sampled completion tokens, completions, packed tokens and micro-batches of
    each mini-batch over all ranks."""
    counts = torch.tensor(
        [[sum(r.generation.sampled_tokens for r in mb), len(mb), sum(len(r.tokens) for r in mb),
          len(micro_batches(mb, micro_batch_tokens))] for mb in minibatches],
        dtype=torch.float64, device=torch.cuda.current_device(),
    )
    torch.distributed.all_reduce(counts)
    return counts


@torch.no_grad()
def _old_logprobs(ddp, rollouts: list[Rollout], micro_batch_tokens: int, temperature: float,
                  compared: _Compared) -> dict[int, torch.Tensor]:
    """The generating policy's logprobs (before any update), by rollout: [len(tokens) - 1]."""
    old = {}
    for micro in micro_batches(rollouts, micro_batch_tokens):
        packed, _ = _pack(micro)
        logprobs, _ = forward_logprobs(ddp, packed.batch, temperature=temperature)
        compared.add(logprobs, packed, micro)
        old.update(zip(map(id, micro), unpack_token_values(logprobs, packed.batch)))
    return old


def _micro_batch_loss(ddp, micro, counts, old_by_rollout, compared, config, ref_model,
                      loss_without_tis: LossConfig | None) -> dict[str, torch.Tensor]:
    """Forward, loss and backward of one micro-batch; its share of the global loss metrics.
    `counts`: [2] global completion tokens and completions of this mini-batch."""
    packed, advantages = _pack(micro)
    batch = packed.batch
    logprobs, entropy = forward_logprobs(ddp, batch, with_entropy=bool(config.loss.entropy_weight),
                                         temperature=config.temperature)
    if old_by_rollout is None:
        old = logprobs.detach()
        compared.add(old, packed, micro)
    else:
        old = pack_token_values([old_by_rollout[id(r)] for r in micro], batch)
    ref = None
    if ref_model is not None:
        with torch.no_grad():
            ref, _ = forward_logprobs(ref_model, batch, temperature=config.temperature)
    weights = token_weights(batch.completion, batch.sequence_ids, config.aggregation,
                            counts[0].item(), counts[1].item())
    inputs = LossInputs(logprobs, old, advantages, weights, packed.engine_logprobs, ref, entropy)
    loss, metrics = policy_loss(inputs, config.loss)
    loss.backward()
    metrics["loss"] = loss.detach()
    if loss_without_tis is not None:  # what the loss would be without the correction
        with torch.no_grad():
            metrics["loss_without_tis"] = policy_loss(inputs, loss_without_tis)[0]
    return metrics


def train_on_rollouts(
    ddp: torch.nn.Module,
    optimizer,
    rollouts: list[Rollout],
    config: StepConfig,
    ref_model: torch.nn.Module | None = None,
    lr_scheduler=None,
    weight_version: int | None = None,
    kept: KeptWeights | None = None,
) -> dict[str, float]:
    """Updates the model; returns global metrics (parity, loss, clip, grad norm, the optimizer
    steps taken, the micro-batches trained on all ranks, the fraction of mini-batches skipped for
    having no completion token on any rank: e.g. dynamic sampling kept no group, or fewer
    rollouts than --grpo-iterations), and this rank's seconds in the optimizer's steps
    (`time/optimizer_s`).
    `lr_scheduler` (megatron-core's OptimizerParamScheduler) steps once per optimizer update;
    `weight_version` (the model's optimizer steps so far) tells rollouts of older weights apart;
    those whose weights are `kept` are also recomputed under them (`bit_wise_versioned/*`)."""
    num_updates = config.updates_per_step
    minibatches = [rollouts[i::num_updates] for i in range(num_updates)]
    counts = _global_counts(minibatches, config.micro_batch_tokens)
    compared = _Compared(weight_version)
    if (counts[:, 0] == 0).all():  # nothing to learn from this step
        return {"update_skipped": 1.0, "optimizer_steps": 0, "time/optimizer_s": 0.0,
                **all_reduce_metrics(compared.terms())}
    # before any update: the recompute compares against the weights as they are now
    versioned = _versioned_terms(ddp, rollouts, kept, weight_version, config) if kept is not None else MetricTerms()
    ddp.train()
    old = None
    if num_updates > 1:
        old = _old_logprobs(ddp, rollouts, config.micro_batch_tokens, config.temperature, compared)
    no_tis = dataclasses.replace(config.loss, tis_cap=None) if config.loss.tis_cap is not None else None
    loss_terms, grad_norm, steps, optimizer_s = MetricTerms(), 0.0, 0, 0.0
    taken = int((counts[:, 0] > 0).sum())  # the logged loss and norm: means over the updates taken
    for update, minibatch in enumerate(minibatches):
        if counts[update, 0] == 0:
            continue
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        scale_router_losses(counts[update, 2])
        for micro in micro_batches(minibatch, config.micro_batch_tokens):
            metrics = _micro_batch_loss(ddp, micro, counts[update], old, compared, config,
                                        ref_model, no_tis)
            for name, value in metrics.items():  # shares of global means: they add up
                loss_terms.sums[name] = loss_terms.sums.get(name, 0.0) + value.item() / taken
            loss_terms.sums["micro_batches"] = loss_terms.sums.get("micro_batches", 0) + 1  # over ranks
        for name, value in router_loss_sums().items():  # MoE: a mean over the micro-batches
            loss_terms.sums[name] = loss_terms.sums.get(name, 0.0) + value / counts[update, 3].item() / taken
        ddp.finish_grad_sync()
        lr = optimizer.param_groups[0]["lr"]
        optimizer_start = _synchronized_time()
        _, norm, _ = optimizer.step()
        optimizer_s += _synchronized_time() - optimizer_start
        grad_norm += (0.0 if norm is None else float(norm)) / taken  # a tensor with TE
        steps += 1
        if lr_scheduler is not None:
            lr_scheduler.step(increment=1)
    result = all_reduce_metrics(loss_terms.update(compared.terms()).update(versioned))
    return {**result, "grad_norm": grad_norm, "update_skipped": 1.0 - steps / num_updates,
            "optimizer_steps": steps, "lr": float(lr), "time/optimizer_s": optimizer_s}


def _synchronized_time() -> float:
    """The time once the GPU's queued work is done: the optimizer's own time, apart from the
    backward before it (a first step's state allocation, the CPU optimizer's copies)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter()
