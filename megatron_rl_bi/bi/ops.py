"""Batch-invariant versions of the ops megatron-core's overrides leave out on the non-TE path.

- `rms_norm`: the local spec's torch RMSNorm is not patched upstream; in BI mode it runs
  megatron-core's `BatchInvariantRMSNormFn` (the one its TE patch uses), else `F.rms_norm`.
- `selective_log_softmax`: log p(token) in fp32 for each row. It calls `torch.log_softmax` on fp32
  logits, exactly as megatron-core's engine does, so in BI mode both sides hit the same
  batch-invariant Triton kernel. Rows are processed in chunks and the backward recomputes the
  softmax, so no [T, V] fp32 tensor is kept for autograd.
"""

import torch
import torch.nn.functional as F
from megatron.core.transformer.custom_layers import batch_invariant_kernels as _mcore_bik

from megatron_rl_bi.bi.switch import enabled

LOG_SOFTMAX_CHUNK_ROWS = 2048


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered_gamma: bool = False
) -> torch.Tensor:
    if enabled():
        return _mcore_bik.BatchInvariantRMSNormFn.apply(x, weight, eps, zero_centered_gamma)
    gamma = weight + 1 if zero_centered_gamma else weight
    return F.rms_norm(x, (x.shape[-1],), gamma, eps)


def _selected_log_probs(logits: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    # [t, V] any float dtype, [t] -> [t] fp32
    log_probs = torch.log_softmax(logits.float(), dim=-1)
    return log_probs.gather(-1, token_ids.unsqueeze(-1)).squeeze(-1)


class _SelectiveLogSoftmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, token_ids: torch.Tensor, chunk_rows: int):
        out = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
        for start in range(0, logits.shape[0], chunk_rows):
            rows = slice(start, start + chunk_rows)
            out[rows] = _selected_log_probs(logits[rows], token_ids[rows])
        ctx.save_for_backward(logits, token_ids)
        ctx.chunk_rows = chunk_rows
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        logits, token_ids = ctx.saved_tensors
        grad_logits = torch.empty_like(logits)
        # d log p_y / d z = onehot(y) - softmax(z); no parity claim on gradients.
        for start in range(0, logits.shape[0], ctx.chunk_rows):
            rows = slice(start, start + ctx.chunk_rows)
            grad = -torch.softmax(logits[rows].float(), dim=-1)
            grad.scatter_add_(
                -1, token_ids[rows].unsqueeze(-1), torch.ones_like(grad[:, :1])
            )
            grad_logits[rows] = (grad * grad_out[rows].unsqueeze(-1)).to(logits.dtype)
        return grad_logits, None, None


def selective_log_softmax(
    logits: torch.Tensor, token_ids: torch.Tensor, chunk_rows: int = LOG_SOFTMAX_CHUNK_ROWS
) -> torch.Tensor:
    """log softmax(logits)[i, token_ids[i]] in fp32. logits [T, V], token_ids [T] -> [T]."""
    if logits.dim() != 2 or token_ids.shape != logits.shape[:1]:
        raise ValueError(
            f"expected logits [T, V] and token_ids [T], got {tuple(logits.shape)} and "
            f"{tuple(token_ids.shape)}"
        )
    return _SelectiveLogSoftmax.apply(logits, token_ids.long(), chunk_rows)
