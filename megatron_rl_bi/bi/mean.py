"""BI mode's `aten::mean.dim`. megatron-core 0.19.2's override (`mean_batch_invariant`) divides by
the sizes of the dims it is given, and a full mean (`x.mean()`, which ATen sends to `mean.dim` with
no dims) gives none: it returns the sum. Here a full mean divides by the element count; a mean over
listed dims goes to megatron-core's kernel unchanged (same bits)."""

import torch
from megatron.core.transformer.custom_layers.batch_invariant_kernels import (
    mean_batch_invariant as _upstream_mean,
)


def mean(input: torch.Tensor, dim, keepdim: bool = False, dtype: torch.dtype | None = None) -> torch.Tensor:
    if dim:
        return _upstream_mean(input, dim, keepdim=keepdim, dtype=dtype)
    out_dtype = dtype or input.dtype
    if not out_dtype.is_floating_point:
        raise TypeError(f"mean of a {input.dtype} tensor needs a floating-point dtype (torch.mean's rule)")
    accumulate = torch.promote_types(out_dtype, torch.float32)
    total = torch.sum(input, dim=tuple(range(input.ndim)), keepdim=keepdim, dtype=accumulate)
    return (total / input.numel()).to(out_dtype)
