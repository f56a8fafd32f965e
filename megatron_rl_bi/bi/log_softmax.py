"""BI mode's log-softmax for a few rows (a decode step's logits), with megatron-core's bits.

megatron-core's kernel (`_log_softmax_kernel`) runs one program per row and walks the row three
times in 1024-wide blocks, each block's reduction waiting on the one before: on a decode step's
[32, 151,936] fp32 logits that is 32 programs on 132 SMs, ~0.2 ms of a ~4 ms graphed step on the
H200 (the bench profile). Here a row is split over several programs along the same blocks: the
row's maximum from per-program maxima (exact in any order), then each block's sum of
exp(x - max) reduced as megatron-core reduces it (same block, same expression, same warps), then
those block sums added one at a time in block order, as its loop adds them. Only the schedule
changes, so the bits are megatron-core's (tests/gpu/test_bi_kernels.py); many rows (the
trainer's chunks, a prefill's prompt tokens) keep megatron-core's kernel, which fills the GPU
with one program a row, and so do short rows, where its one launch costs the host less than the
split's three save the GPU.
"""

import torch
import triton
import triton.language as tl
from megatron.core.transformer.custom_layers import batch_invariant_kernels as _mcore_bik

from megatron_rl_bi.bi.gemm import streaming_multiprocessors

MCORE_LOG_SOFTMAX = _mcore_bik.log_softmax
BLOCK_SIZE = 1024  # megatron-core's block
NUM_WARPS = 4  # megatron-core's launch (Triton's default): the same reduction tree in a block
# Rows of up to this many blocks keep megatron-core's one launch. On the H200 at 32 rows
# (bench/decode_tail.py, results/bench_decode_tail_h200.json) its GPU time grows ~1.2 us a block
# (25 us at 32 blocks, 168 us at 149) while the split runs in 10-23 us, and the split's two extra
# launches cost the host 45-57 us: they pay off from ~60 blocks a row.
MAX_UNSPLIT_BLOCKS = 64


@triton.jit
def _blocks_of_this_program(n_blocks, blocks_per_program):
    first = tl.program_id(1) * blocks_per_program
    return first, tl.minimum(first + blocks_per_program, n_blocks)


@triton.jit
def _row_max(partial_max_ptr, row, parts, PARTS: tl.constexpr):
    offsets = tl.arange(0, PARTS)
    return tl.max(tl.load(partial_max_ptr + row * parts + offsets, mask=offsets < parts, other=-float("inf")))


@triton.jit
def _partial_max_kernel(x_ptr, partial_max_ptr, x_row_stride, n_cols, n_blocks, blocks_per_program,
                        BLOCK_SIZE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    first, last = _blocks_of_this_program(n_blocks, blocks_per_program)
    max_val = -float("inf")
    for block in range(first, last):
        cols = block * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
        vals = tl.load(x_ptr + row * x_row_stride + cols, mask=cols < n_cols, other=-float("inf"))
        max_val = tl.max(tl.maximum(vals, max_val))
    tl.store(partial_max_ptr + row * tl.num_programs(1) + tl.program_id(1), max_val)


@triton.jit
def _block_sums_kernel(x_ptr, partial_max_ptr, sums_ptr, x_row_stride, n_cols, n_blocks, blocks_per_program,
                       parts, BLOCK_SIZE: tl.constexpr, PARTS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    max_val = _row_max(partial_max_ptr, row, parts, PARTS)
    first, last = _blocks_of_this_program(n_blocks, blocks_per_program)
    for block in range(first, last):
        cols = block * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
        mask = cols < n_cols
        vals = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0)
        exp_vals = tl.exp(vals - max_val)
        tl.store(sums_ptr + row * n_blocks + block, tl.sum(tl.where(mask, exp_vals, 0.0)))


@triton.jit
def _write_kernel(x_ptr, partial_max_ptr, sums_ptr, out_ptr, x_row_stride, out_row_stride, n_cols,
                  blocks_per_program, parts, N_BLOCKS: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                  PARTS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    max_val = _row_max(partial_max_ptr, row, parts, PARTS)
    sum_exp = 0.0
    for block in tl.static_range(N_BLOCKS):  # block order, one fp32 add at a time
        sum_exp += tl.load(sums_ptr + row * N_BLOCKS + block)
    log_sum_exp = tl.log(sum_exp)
    first, last = _blocks_of_this_program(N_BLOCKS, blocks_per_program)
    for block in range(first, last):
        cols = block * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
        mask = cols < n_cols
        vals = tl.load(x_ptr + row * x_row_stride + cols, mask=mask)
        tl.store(out_ptr + row * out_row_stride + cols, vals - max_val - log_sum_exp, mask=mask)


def split_rows_log_softmax(x: torch.Tensor, parts: int) -> torch.Tensor:
    """log_softmax over the last dim of a 2D fp32 `x`, each row split over up to `parts` programs."""
    n_rows, n_cols = x.shape
    n_blocks = triton.cdiv(n_cols, BLOCK_SIZE)
    blocks_per_program = triton.cdiv(n_blocks, min(parts, n_blocks))
    parts = triton.cdiv(n_blocks, blocks_per_program)  # none without a block
    partial_max = torch.empty((n_rows, parts), device=x.device, dtype=torch.float32)
    sums = torch.empty((n_rows, n_blocks), device=x.device, dtype=torch.float32)
    out = torch.empty_like(x)
    grid, padded_parts = (n_rows, parts), triton.next_power_of_2(parts)
    _partial_max_kernel[grid](x, partial_max, x.stride(0), n_cols, n_blocks, blocks_per_program,
                              BLOCK_SIZE=BLOCK_SIZE, num_warps=NUM_WARPS)
    _block_sums_kernel[grid](x, partial_max, sums, x.stride(0), n_cols, n_blocks, blocks_per_program, parts,
                             BLOCK_SIZE=BLOCK_SIZE, PARTS=padded_parts, num_warps=NUM_WARPS)
    _write_kernel[grid](x, partial_max, sums, out, x.stride(0), out.stride(0), n_cols, blocks_per_program, parts,
                        N_BLOCKS=n_blocks, BLOCK_SIZE=BLOCK_SIZE, PARTS=padded_parts, num_warps=NUM_WARPS)
    return out


def programs_per_row(rows: int, sms: int) -> int:
    """~4 programs an SM: a program waits on each block's reduction, so latency bounds it, not
    bandwidth."""
    return triton.cdiv(4 * sms, rows)


def split_parts(rows: int, cols: int, sms: int) -> int:
    """Programs per row for a [rows, cols] log-softmax on `sms` SMs: 1 (megatron-core's kernel)
    for as many rows as SMs or for rows of at most MAX_UNSPLIT_BLOCKS blocks, else
    `programs_per_row`."""
    if rows >= sms or triton.cdiv(cols, BLOCK_SIZE) <= MAX_UNSPLIT_BLOCKS:
        return 1
    return programs_per_row(rows, sms)


def log_softmax(input: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """megatron-core's `log_softmax(input, dim)` (its aten::_log_softmax override calls it): fp32
    CUDA input whose rows `split_parts` splits runs the split kernel, the rest megatron-core's."""
    if (dim not in (-1, input.dim() - 1) or input.dtype != torch.float32 or not input.is_cuda
            or input.dim() == 0 or input.numel() == 0):
        return MCORE_LOG_SOFTMAX(input, dim=dim)
    cols = input.shape[-1]
    parts = split_parts(input.numel() // cols, cols, streaming_multiprocessors(input.device))
    if parts == 1:
        return MCORE_LOG_SOFTMAX(input, dim=dim)
    return split_rows_log_softmax(input.reshape(-1, cols).contiguous(), parts).reshape(input.shape)
