"""Policy losses as pure functions over per-token tensors: no model, no distributed calls.

One clipped-surrogate loss serves both algorithms:
- GRPO: symmetric clip (eps_low == eps_high), optional k3 KL to a frozen reference, sequence-mean
  aggregation (each completion weighs the same);
- DAPO: clip-higher (eps_low 0.2, eps_high 0.28), no KL, token-level aggregation.
Aggregation is carried by `token_weights` (see `token_weights`), normalized by counts over the
whole global batch, so any split into micro-batches or ranks sums to the same gradient.

Truncated importance sampling (TIS, for runs whose engine and trainer disagree): each token's
surrogate is multiplied by min(pi_old / pi_engine, cap), detached, where pi_old is the trainer's
recomputed logprob (the policy the ratio is taken against) and pi_engine the one the token was
sampled from. In BI mode pi_old == pi_engine bit for bit and the weight is exactly 1.
"""

from dataclasses import dataclass

import torch


@dataclass(kw_only=True)
class LossConfig:
    eps_low: float = 0.2
    """Lower clip: the ratio is clipped at 1 - eps_low (--grpo-clamp-eps-lower)."""
    eps_high: float = 0.2
    """Upper clip: 1 + eps_high; DAPO's clip-higher uses 0.28 (--grpo-clamp-eps-upper)."""
    kl_beta: float = 0.0
    """Weight of the k3 KL estimate to the reference policy (--grpo-kl-beta)."""
    entropy_weight: float = 0.0
    """Weight of the entropy bonus, subtracted from the loss (--grpo-entropy-term-weight)."""
    tis_cap: float | None = None
    """Truncated importance-sampling cap; None disables the correction
    (--rl-importance-sampling-truncation-coef, with --rl-inference-logprobs-is-correction)."""


@dataclass
class LossInputs:
    logprobs: torch.Tensor  # [T] trainer, with grad
    old_logprobs: torch.Tensor  # [T] detached: the policy of the ratio's denominator
    advantages: torch.Tensor  # [T] per token (the completion's advantage)
    token_weights: torch.Tensor  # [T] aggregation weights, 0 outside completions
    engine_logprobs: torch.Tensor | None = None  # [T] the sampler's logprobs (TIS)
    ref_logprobs: torch.Tensor | None = None  # [T] frozen reference (KL)
    entropy: torch.Tensor | None = None  # [T] per-token entropy, with grad


def token_weights(
    completion_mask: torch.Tensor,
    sequence_ids: torch.Tensor,
    aggregation: str,
    global_tokens: float,
    global_sequences: float,
) -> torch.Tensor:
    """Per-token loss weights whose sum over the global batch is 1.

    completion_mask [T] bool, sequence_ids [T] (which completion each token belongs to),
    'token': 1 / global_tokens; 'sequence': 1 / (tokens of this completion * global_sequences).
    """
    mask = completion_mask.float()
    if aggregation == "token":
        return mask / global_tokens
    if aggregation == "sequence":
        lengths = torch.zeros(int(sequence_ids.max()) + 1, device=mask.device)
        lengths.index_add_(0, sequence_ids, mask)
        per_token_length = lengths[sequence_ids].clamp(min=1)
        return mask / (per_token_length * global_sequences)
    raise ValueError(f"aggregation {aggregation}: expected 'token' or 'sequence'")


def policy_loss(inputs: LossInputs, config: LossConfig) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Returns the scalar loss (this batch's share of the global loss) and detached metrics."""
    weights = inputs.token_weights
    counted = weights != 0
    # Positions outside completions may hold anything (-inf, NaN); zero them before any
    # arithmetic so neither the loss nor its gradient can pick up a NaN from them.
    logprobs, old_logprobs, engine_logprobs, ref_logprobs = (
        None if t is None else torch.where(counted, t, torch.zeros_like(t))
        for t in (inputs.logprobs, inputs.old_logprobs, inputs.engine_logprobs, inputs.ref_logprobs)
    )
    log_ratio = logprobs - old_logprobs
    ratio = torch.exp(log_ratio)
    clipped = ratio.clamp(1 - config.eps_low, 1 + config.eps_high)
    surrogate = torch.minimum(ratio * inputs.advantages, clipped * inputs.advantages)
    metrics = {}
    if config.tis_cap is not None:
        if engine_logprobs is None:
            raise ValueError("tis_cap needs engine_logprobs")
        tis = torch.exp(old_logprobs - engine_logprobs).clamp(max=config.tis_cap)
        surrogate = surrogate * tis.detach()
        metrics["tis/weight_mean"] = _weighted_mean(tis, weights)
        metrics["tis/capped_fraction"] = _weighted_mean((tis >= config.tis_cap).float(), weights)
    per_token = -surrogate
    if config.kl_beta:
        if ref_logprobs is None:
            raise ValueError("kl_beta > 0 needs ref_logprobs")
        # k3 estimator of KL(pi || pi_ref): exp(r) - r - 1 with r = log pi_ref - log pi, >= 0
        log_ref_ratio = ref_logprobs - logprobs
        kl = torch.exp(log_ref_ratio) - log_ref_ratio - 1
        per_token = per_token + config.kl_beta * kl
        metrics["kl"] = _weighted_mean(kl, weights)
    if config.entropy_weight:
        if inputs.entropy is None:
            raise ValueError("entropy_weight > 0 needs entropy")
        entropy = torch.where(counted, inputs.entropy, torch.zeros_like(inputs.entropy))
        per_token = per_token - config.entropy_weight * entropy
        metrics["entropy"] = _weighted_mean(entropy, weights)
    loss = (per_token * weights).sum()
    is_clipped = clipped * inputs.advantages < ratio * inputs.advantages  # min took the clip
    metrics["clip_fraction"] = _weighted_mean(is_clipped.float(), weights)
    metrics["ratio_mean"] = _weighted_mean(ratio, weights)
    return loss, metrics


def _weighted_mean(values: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Share of the global weighted mean (weights sum to 1 over the global batch)."""
    return (values.detach() * weights).sum()
