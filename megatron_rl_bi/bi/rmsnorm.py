"""The batch-invariant RMSNorm behind BI mode's norms (forward and backward, one kernel each).

megatron-core's `BatchInvariantRMSNormFn` runs its row-mean kernel plus ~5 torch elementwise
ops forward and ~15 backward, each a pass over the [tokens, hidden] activations in fp32 (the
extra aten::mul/copy of a BI trainer step in results/profile_dense16_h200.json). Here one program
normalizes one row: the row's sum of squares is one `tl.sum` over the whole row, whatever else
is in the batch, so a row's output does not depend on how many rows run with it. The backward
computes dx per row the same way; the weight gradient sums fixed blocks of `ROWS_PER_PROGRAM`
rows in order, then the blocks in order (deterministic for a given shape; it is not a parity
quantity). `1 + weight` (zero-centred gamma) is formed in fp32. `te_apply_normalization` puts the
same forward behind TransformerEngine's fused norm+linear modules in BI mode.
"""

import torch
import triton
import triton.language as tl
from megatron.core.transformer.custom_layers import batch_invariant_kernels as _mcore_bik

ROWS_PER_PROGRAM = 64


@triton.jit
def _forward(x_ptr, w_ptr, y_ptr, rsigma_ptr, D, eps,
             ZERO_CENTERED: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < D
    x = tl.load(x_ptr + row * D + cols, mask=mask, other=0.0).to(tl.float32)
    rsigma = tl.math.rsqrt(tl.sum(x * x, axis=0) / D + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if ZERO_CENTERED:
        w = w + 1.0
    tl.store(y_ptr + row * D + cols, (x * rsigma * w).to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(rsigma_ptr + row, rsigma)


# `rows` only bounds the loop, and a packed batch's count varies from call to call: unspecialized, one
# variant per width, with the machine code of its rows-a-multiple-of-16 compile (CPU test).
@triton.jit(do_not_specialize=["rows"])
def _backward(dy_ptr, x_ptr, w_ptr, rsigma_ptr, dx_ptr, dw_partial_ptr, rows, D,
              ZERO_CENTERED: tl.constexpr, ROWS_PER_PROGRAM: tl.constexpr, BLOCK: tl.constexpr):
    """dx = rsigma * (w * dy - x * rsigma^2 * mean(w * dy * x)); this program's share of dw."""
    program = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < D
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if ZERO_CENTERED:
        w = w + 1.0
    dw = tl.zeros((BLOCK,), dtype=tl.float32)
    for i in range(ROWS_PER_PROGRAM):
        row = program * ROWS_PER_PROGRAM + i
        if row < rows:
            x = tl.load(x_ptr + row * D + cols, mask=mask, other=0.0).to(tl.float32)
            dy = tl.load(dy_ptr + row * D + cols, mask=mask, other=0.0).to(tl.float32)
            rsigma = tl.load(rsigma_ptr + row)
            x_hat = x * rsigma
            wdy = w * dy
            dx = rsigma * (wdy - x_hat * (tl.sum(wdy * x_hat, axis=0) / D))
            tl.store(dx_ptr + row * D + cols, dx.to(dx_ptr.dtype.element_ty), mask=mask)
            dw += dy * x_hat
    tl.store(dw_partial_ptr + program * D + cols, dw, mask=mask)


def _launch_options(d: int) -> dict:
    block = triton.next_power_of_2(d)
    return {"BLOCK": block, "num_warps": min(max(block // 256, 1), 16)}


def normalize(rows_2d: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered_gamma: bool,
              dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward kernel on contiguous [rows, D]: (y in `dtype`, default x's; rsigma fp32 [rows])."""
    rows, d = rows_2d.shape
    y = torch.empty_like(rows_2d, dtype=dtype or rows_2d.dtype)
    rsigma = torch.empty(rows, device=rows_2d.device, dtype=torch.float32)
    if rows:
        _forward[(rows,)](rows_2d, weight.contiguous(), y, rsigma, d, eps,
                          ZERO_CENTERED=zero_centered_gamma, **_launch_options(d))
    return y, rsigma


class BatchInvariantRMSNorm(torch.autograd.Function):
    """`apply(x, weight, eps, zero_centered_gamma)`: the contract of megatron-core's
    `BatchInvariantRMSNormFn`, which the BI switch replaces with this."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered_gamma: bool):
        rows_2d = x.reshape(-1, x.shape[-1]).contiguous()
        y, rsigma = normalize(rows_2d, weight, eps, zero_centered_gamma)
        ctx.save_for_backward(rows_2d, weight, rsigma)
        ctx.zero_centered_gamma = zero_centered_gamma
        return y.reshape(x.shape)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x, weight, rsigma = ctx.saved_tensors
        rows, d = x.shape
        dy_2d = dy.reshape(rows, d).contiguous()
        dx = torch.empty_like(x)
        programs = triton.cdiv(rows, ROWS_PER_PROGRAM)
        dw_partial = torch.zeros(max(programs, 1), d, device=x.device, dtype=torch.float32)
        if rows:
            _backward[(programs,)](dy_2d, x, weight.contiguous(), rsigma, dx, dw_partial, rows, d,
                                   ZERO_CENTERED=ctx.zero_centered_gamma,
                                   ROWS_PER_PROGRAM=ROWS_PER_PROGRAM, **_launch_options(d))
        return dx.reshape(dy.shape), dw_partial.sum(0).to(weight.dtype), None, None


UPSTREAM_TE_APPLY_NORMALIZATION = _mcore_bik._te_apply_normalization_patched


def te_apply_normalization(inputmat, ln_out, ln_weight, ln_bias, eps, output_quantizer, output_dtype,
                           normalization, fwd_ln_sm_margin, zero_centered_gamma):
    """TE's `apply_normalization` (the norm inside LayerNormLinear / LayerNormMLP) in BI mode,
    installed by the switch in place of megatron-core 0.19.2's patch, which computes RMSNorm in
    ~8 fp32 torch passes plus its row-mean kernel: the forward kernel above, returning TE's
    (ln_out, mu=None, rsigma) for TE's own backward. LayerNorm, a bias, FP8 output and BI mode
    off go to megatron-core's patch (which hands them to TE)."""
    if (not _mcore_bik.is_batch_invariant_mode_enabled() or normalization != "RMSNorm"
            or output_quantizer is not None or ln_bias is not None):
        return UPSTREAM_TE_APPLY_NORMALIZATION(inputmat, ln_out, ln_weight, ln_bias, eps, output_quantizer,
                                               output_dtype, normalization, fwd_ln_sm_margin,
                                               zero_centered_gamma)
    rows_2d = inputmat.reshape(-1, inputmat.shape[-1]).contiguous()
    y, rsigma = normalize(rows_2d, ln_weight, eps, zero_centered_gamma, dtype=output_dtype)
    if ln_out is None:
        return y.reshape(inputmat.shape), None, rsigma
    ln_out.copy_(y.reshape(ln_out.shape))
    return ln_out, None, rsigma
