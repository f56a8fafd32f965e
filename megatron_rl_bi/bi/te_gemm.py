"""TransformerEngine's `general_gemm` in BI mode: what TE's linear modules call for their forward,
input-gradient and weight-gradient products, installed by the BI switch in place of
megatron-core 0.19.2's `_te_general_gemm_patched`.

megatron-core's version copies operands into transposes before its GEMM: the whole weight at
every forward product, and the output gradient at every weight gradient. The latter's row stride
is then the token count, which TMA cannot describe unless it is a multiple of 8, so most RL
batches (packed to any length) sent those products to megatron-core's slow kernel (the TE BI
update measured 1.68x default on the H200, the local path 1.08x). It also ignores `accumulate`:
under gradient-accumulation fusion TE asks to add the weight gradient into `main_grad`, and it
overwrote it. This one hands `gemm.matmul` transposed views, the layouts the local path
gives it, and adds when asked. Bias is added after rounding, as megatron-core does. Like TE's own
GEMM (and unlike megatron-core's, an autograd Function) it records no autograd graph: TE calls it
inside its own autograd Functions, and a delayed weight gradient run with grad enabled must not
hang a graph on `main_grad`.
"""

import torch
from megatron.core.transformer.custom_layers import batch_invariant_kernels as _mcore_bik

from megatron_rl_bi.bi import gemm

UPSTREAM = _mcore_bik._te_general_gemm_patched


def _unsupported(quantization_params, gelu, alpha, beta, accumulate, ub, ub_type, extra_output,
                 bulk_overlap) -> str | None:
    """The first requested feature this GEMM does not have, by its argument name."""
    if quantization_params is not None:
        return "quantization_params (FP8)"
    if gelu:
        return "gelu"
    if alpha != 1.0:
        return "alpha"
    if beta is not None and beta != float(accumulate):
        return "beta"
    if ub is not None or ub_type is not None or extra_output is not None or bulk_overlap:
        return "ub/ub_type/extra_output/bulk_overlap (Userbuffers overlap)"
    return None


def general_gemm(A, B, out_dtype=None, quantization_params=None, gelu=False, gelu_in=None, alpha=1.0,
                 beta=None, accumulate=False, layout="TN", out=None, bias=None,
                 use_split_accumulator=False, grad=False, ub=None, ub_type=None, extra_output=None,
                 bulk_overlap=False):
    """TE's `general_gemm(A, B, layout=...)`: op(B) @ op(A) with op a transpose where `layout`
    says T ("TN" forward x @ W.T, "NN" input gradient dy @ W, "NT" weight gradient dy.T @ x).
    Returns TE's (output, bias gradient, None, None)."""
    feature = _unsupported(quantization_params, gelu, alpha, beta, accumulate, ub, ub_type, extra_output,
                           bulk_overlap)
    if feature is not None:
        raise NotImplementedError(f"batch-invariant mode: TransformerEngine GEMM with {feature} is not supported")
    with torch.no_grad():
        result, bias_grad = _product(A, B, out_dtype, layout, bias, grad)
    if out is None:
        return result, bias_grad, None, None
    if accumulate:
        out.add_(result)
    else:
        out.copy_(result)
    return out, bias_grad, None, None


def _product(A, B, out_dtype, layout, bias, grad):
    transa, transb = layout[0] == "T", layout[1] == "T"
    if A.dtype != B.dtype or A.dtype not in (torch.bfloat16, torch.float16) or (transa and A.dim() != 2):
        # fp32 operands, or a transposed operand that is not a matrix: megatron-core's.
        result, bias_grad, *_ = UPSTREAM(A, B, out_dtype=out_dtype, layout=layout, bias=bias, grad=grad)
        return result, bias_grad
    # TE's Linear keeps its [s, b, h] input for the weight gradient (layout NT): flattened, as TE
    # does; the flattening is a view.
    weight = A.t() if transa else A.reshape(-1, A.shape[-1])
    rows = B.reshape(-1, B.shape[-1])
    rows = rows.t() if transb else rows
    result = gemm.matmul(rows, weight)
    if not transb:
        result = result.reshape(*B.shape[:-1], result.shape[-1])
    if bias is not None and not grad:
        result = result + bias
    if out_dtype is not None:
        result = result.to(out_dtype)
    bias_grad = B.reshape(-1, B.shape[-1]).sum(dim=0) if grad and bias is not None else None
    return result, bias_grad
