"""One policy update from rollouts: pack -> trainer logprobs -> parity -> loss -> optimizer step.

Rollouts are split into `updates_per_step` mini-batches (one optimizer step each) and each
mini-batch into packed micro-batches of at most `micro_batch_tokens` tokens. The loss of a
mini-batch is normalized by its global (all data-parallel ranks) token or sequence count, so the
gradient does not depend on the micro-batch split. With more than one update, the trainer's
logprobs before the first update are the ratio's denominator ("old"); with one update the
ratio is 1 and only the advantage (and TIS weight) matter.
"""

import dataclasses
from dataclasses import dataclass, field

import torch

from megatron_rl_bi.models.logprobs import forward_logprobs
from megatron_rl_bi.rl.losses import LossConfig, LossInputs, policy_loss, token_weights
from megatron_rl_bi.rl.packing import (
    PackedBatch,
    completion_mask,
    micro_batches,
    pack_sequences,
    pack_token_values,
)
from megatron_rl_bi.rl.parity import parity_metrics
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


@dataclass
class _Packed:
    batch: PackedBatch
    completion: torch.Tensor  # [T] bool: predicting positions of completion tokens
    engine_logprobs: torch.Tensor  # [T] fp32
    advantages: torch.Tensor  # [T] fp32
    sequence_ids: torch.Tensor  # [T] int64, local to the micro-batch


def pack_rollouts(rollouts: list[Rollout], device) -> _Packed:
    """Rollouts -> one THD micro-batch with per-position completion mask, engine logprobs,
    advantages and sequence ids (laid out by predicting position, see rl/packing.py)."""
    batch = pack_sequences([r.tokens for r in rollouts])
    prompt_lens = [len(r.prompt_tokens) for r in rollouts]
    completion = [completion_mask(p, len(r.tokens)) for r, p in zip(rollouts, prompt_lens)]
    engine = [
        torch.tensor([0.0] * (p - 1) + r.engine_logprobs, dtype=torch.float32)
        for r, p in zip(rollouts, prompt_lens)
    ]
    advantages = [torch.full((len(r.tokens) - 1,), r.advantage) for r in rollouts]
    sequence_ids = [torch.full((len(r.tokens) - 1,), i) for i, r in enumerate(rollouts)]
    return _Packed(
        batch=batch.to(device),
        completion=pack_token_values(completion, batch).to(device),
        engine_logprobs=pack_token_values(engine, batch).to(device),
        advantages=pack_token_values(advantages, batch).float().to(device),
        sequence_ids=pack_token_values(sequence_ids, batch).long().to(device),
    )


def _all_reduce(values: torch.Tensor, op=torch.distributed.ReduceOp.SUM) -> torch.Tensor:
    torch.distributed.all_reduce(values, op=op)
    return values


def _global_parity(train: torch.Tensor, engine: torch.Tensor, mask: torch.Tensor) -> dict:
    """parity_metrics pooled over data-parallel ranks (each rank compares its own engine)."""
    local = parity_metrics(train, engine, mask)
    tokens = local["bit_wise/tokens"]
    sums = torch.tensor(
        [
            local["bit_wise/logprob_diff/mean"] * tokens if tokens else 0.0,
            local["bit_wise/logprob_diff/abs_mean"] * tokens if tokens else 0.0,
            local["bit_wise/ratio_tokens_different"] * tokens if tokens else 0.0,
            float(tokens),
        ],
        dtype=torch.float64, device=torch.cuda.current_device(),
    )
    _all_reduce(sums)
    worst = _all_reduce(
        torch.tensor([local["bit_wise/logprob_diff/max"] if tokens else 0.0],
                     dtype=torch.float64, device=torch.cuda.current_device()),
        torch.distributed.ReduceOp.MAX,
    )
    total = sums[3].item()
    if total == 0:
        return parity_metrics(train, engine, torch.zeros_like(mask))  # NaN diffs, 0 tokens
    return {
        "bit_wise/logprob_diff/mean": sums[0].item() / total,
        "bit_wise/logprob_diff/abs_mean": sums[1].item() / total,
        "bit_wise/logprob_diff/max": worst.item(),
        "bit_wise/ratio_tokens_different": sums[2].item() / total,
        "bit_wise/tokens": int(total),
    }


def _global_counts(minibatches: list[list[Rollout]]) -> torch.Tensor:
    """[updates, 2]: completion tokens and completions of each mini-batch over all ranks."""
    counts = torch.tensor(
        [[sum(len(r.completion_tokens) for r in mb), len(mb)] for mb in minibatches],
        dtype=torch.float64, device=torch.cuda.current_device(),
    )
    return _all_reduce(counts)


def train_on_rollouts(
    ddp: torch.nn.Module,
    optimizer,
    rollouts: list[Rollout],
    config: StepConfig,
    ref_model: torch.nn.Module | None = None,
) -> dict[str, float]:
    """Updates the model; returns global metrics (parity, loss, clip, grad norm...)."""
    num_updates = config.updates_per_step
    minibatches = [rollouts[i::num_updates] for i in range(num_updates)]
    counts = _global_counts(minibatches)
    if (counts[:, 0] == 0).all():
        # e.g. dynamic sampling kept no group on any rank: nothing to learn from this step.
        empty = torch.zeros(0)
        return {"update_skipped": 1.0, **_global_parity(empty, empty, empty.bool())}
    if (counts[:, 0] == 0).any():
        raise ValueError("a mini-batch has no completion tokens: fewer rollouts than --grpo-iterations")
    ddp.train()
    with_entropy = bool(config.loss.entropy_weight)
    needs_old = num_updates > 1
    old_by_rollout, parity_parts = {}, []
    if needs_old:  # the policy that generated, before any update
        with torch.no_grad():
            for micro in micro_batches(rollouts, config.micro_batch_tokens):
                packed = pack_rollouts(micro, torch.cuda.current_device())
                logprobs, _ = forward_logprobs(ddp, packed.batch)
                parity_parts.append((logprobs, packed.engine_logprobs, packed.completion))
                for rollout, old in zip(micro, _split(logprobs, packed)):
                    old_by_rollout[id(rollout)] = old
    # With TIS, also log what the loss would be without the correction, to show its effect.
    no_tis = None
    if config.loss.tis_cap is not None:
        no_tis = dataclasses.replace(config.loss, tis_cap=None)
    totals: dict[str, float] = {}
    for update, minibatch in enumerate(minibatches):
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        for micro in micro_batches(minibatch, config.micro_batch_tokens):
            packed = pack_rollouts(micro, torch.cuda.current_device())
            logprobs, entropy = forward_logprobs(ddp, packed.batch, with_entropy)
            if needs_old:
                old = torch.cat([old_by_rollout[id(r)] for r in micro])
            else:
                old = logprobs.detach()
                parity_parts.append((old, packed.engine_logprobs, packed.completion))
            ref = None
            if ref_model is not None:
                with torch.no_grad():
                    ref, _ = forward_logprobs(ref_model, packed.batch)
            weights = token_weights(
                packed.completion, packed.sequence_ids, config.aggregation,
                counts[update, 0].item(), counts[update, 1].item(),
            )
            inputs = LossInputs(logprobs, old, packed.advantages, weights,
                                packed.engine_logprobs, ref, entropy)
            loss, metrics = policy_loss(inputs, config.loss)
            loss.backward()
            metrics["loss"] = loss.detach()
            if no_tis is not None:
                with torch.no_grad():
                    metrics["loss_without_tis"] = policy_loss(inputs, no_tis)[0]
            for name, value in metrics.items():
                totals[name] = totals.get(name, 0.0) + value.item() / num_updates
        ddp.finish_grad_sync()
        _, grad_norm, _ = optimizer.step()
        totals["grad_norm"] = totals.get("grad_norm", 0.0) + (grad_norm or 0.0) / num_updates
    # A rank can have no rollouts in a step (dynamic sampling); reduce over the union of names.
    local_names = [n for n in totals if n != "grad_norm"]
    every_rank = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(every_rank, local_names)
    names = sorted(set().union(*every_rank))
    summed = _all_reduce(torch.tensor([totals.get(n, 0.0) for n in names], dtype=torch.float64,
                                      device=torch.cuda.current_device()))
    result = dict(zip(names, summed.tolist()))
    result["grad_norm"] = totals["grad_norm"]
    result["update_skipped"] = 0.0
    empty = [(torch.zeros(0), torch.zeros(0), torch.zeros(0, dtype=torch.bool))]
    train, engine, mask = (torch.cat([t.cpu() for t in parts]) for parts in zip(*(parity_parts or empty)))
    result.update(_global_parity(train, engine, mask))
    return result


def _split(values: torch.Tensor, packed: _Packed) -> list[torch.Tensor]:
    lengths = (packed.batch.cu_seqlens[1:] - packed.batch.cu_seqlens[:-1]).tolist()
    return list(torch.split(values, lengths))
