"""Batch-invariant versions of the ops megatron-core's overrides leave out on the non-TE path.

- `rms_norm`: the local spec's torch RMSNorm is not patched upstream; in BI mode it runs
  `bi.rmsnorm.BatchInvariantRMSNorm` (which the switch also puts behind megatron-core's TE norm
  patch), else `F.rms_norm`; a zero-centred weight (`1 + weight`) is formed in fp32 in both.
- `selective_log_softmax`: log p(token) in fp32 for each row, of the distribution at a sampling
  temperature. It calls `torch.log_softmax` on fp32 logits (divided by the temperature the way
  megatron-core's torch sampling backend divides them for processed logprobs), exactly as the
  engine does, so in BI mode both sides hit the same batch-invariant Triton kernel. Rows are
  processed in chunks and the backward recomputes the softmax, so no [T, V] fp32 tensor is kept
  for autograd.
"""

import torch
import torch.nn.functional as F

from megatron_rl_bi.bi.rmsnorm import BatchInvariantRMSNorm
from megatron_rl_bi.bi.switch import enabled, left_off

LOG_SOFTMAX_CHUNK_ROWS = 2048


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered_gamma: bool = False
) -> torch.Tensor:
    if enabled("rmsnorm"):
        return BatchInvariantRMSNorm.apply(x, weight, eps, zero_centered_gamma)
    if zero_centered_gamma:  # in fp32, as transformers' Qwen3.5 norm: 1 + weight is not rounded
        return F.rms_norm(x.float(), (x.shape[-1],), weight.float() + 1, eps).to(x.dtype)
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def sampling_logits(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """fp32 logits of the distribution the engine samples from at `temperature`, computed as
    megatron-core's torch sampling backend computes them for its processed logprobs (an fp32
    copy divided in place by the temperature, which the engine keeps as fp32 request metadata
    and hands over as a Python float), so the bits agree. With the fp32_logits piece left off (the
    doctor's ablation) they stay in the params dtype."""
    temperature = torch.tensor(temperature, dtype=torch.float32).item()
    scaled = logits if left_off("fp32_logits") else logits.float()
    if temperature != 1.0:
        scaled = (scaled.clone() if scaled is logits else scaled).div_(temperature)
    return scaled


def _selected_log_probs(logits: torch.Tensor, token_ids: torch.Tensor, temperature: float) -> torch.Tensor:
    # [t, V] any float dtype, [t] -> [t] fp32
    log_probs = torch.log_softmax(sampling_logits(logits, temperature), dim=-1)
    return log_probs.gather(-1, token_ids.unsqueeze(-1)).squeeze(-1)


class _SelectiveLogSoftmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, token_ids: torch.Tensor, chunk_rows: int,
                temperature: float):
        out = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
        for start in range(0, logits.shape[0], chunk_rows):
            rows = slice(start, start + chunk_rows)
            out[rows] = _selected_log_probs(logits[rows], token_ids[rows], temperature)
        ctx.save_for_backward(logits, token_ids)
        ctx.chunk_rows, ctx.temperature = chunk_rows, temperature
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        logits, token_ids = ctx.saved_tensors
        grad_logits = torch.empty_like(logits)
        # d log p_y / d z = (onehot(y) - softmax(z / T)) / T; no parity claim on gradients.
        for start in range(0, logits.shape[0], ctx.chunk_rows):
            rows = slice(start, start + ctx.chunk_rows)
            grad = -torch.softmax(sampling_logits(logits[rows], ctx.temperature), dim=-1)
            grad.scatter_add_(
                -1, token_ids[rows].unsqueeze(-1), torch.ones_like(grad[:, :1])
            )
            scale = grad_out[rows].unsqueeze(-1) / ctx.temperature
            grad_logits[rows] = (grad * scale).to(logits.dtype)
        return grad_logits, None, None, None


def selective_log_softmax(
    logits: torch.Tensor, token_ids: torch.Tensor, chunk_rows: int = LOG_SOFTMAX_CHUNK_ROWS,
    temperature: float = 1.0,
) -> torch.Tensor:
    """log softmax(logits / temperature)[i, token_ids[i]] in fp32. logits [T, V], token_ids [T]
    -> [T]."""
    if logits.dim() != 2 or token_ids.shape != logits.shape[:1]:
        raise ValueError(
            f"expected logits [T, V] and token_ids [T], got {tuple(logits.shape)} and "
            f"{tuple(token_ids.shape)}"
        )
    if temperature <= 0:
        raise ValueError(f"temperature {temperature} must be > 0")
    return _SelectiveLogSoftmax.apply(logits, token_ids.long(), chunk_rows, temperature)
