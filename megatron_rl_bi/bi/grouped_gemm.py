"""The experts' batch-invariant grouped GEMM: each expert's rows times its own weight, all experts in
one launch.

megatron-core's SequentialMLP runs its experts one after another: a host sync to split the rows,
then two BI GEMM launches and the activation's kernels per expert. At 128 experts a layer that is
host-bound (Qwen3-30B-A3B's widths at 8 layers decoded at ~0.4 s a step on the H200,
results/README.md). Here one program computes one tile of one expert's rows: the tiles' experts
are found on the GPU from the experts' row counts (no host sync), and each expert's weight is
reached through a table of pointers. What keeps a row's bits those of the BI GEMM on its own
rows (bi/gemm.py): no split-K, and K reduced in order into one fp32 accumulator, so the MMA
instructions accumulate 16 K values at a time in K order whatever the tile and however many rows
the expert has; tests/gpu/test_bi_gemm.py checks the bits against `gemm.matmul` expert by expert.
"""

import torch
import triton
import triton.language as tl

BLOCK_M = 64  # the BI GEMM's decode tile: one warpgroup MMA of 64 rows
BLOCK_N = 64
BLOCK_K = 64


@triton.jit
def _grouped_matmul(
    rows_ptr, weight_table_ptr, out_ptr, row_offsets_ptr, tile_offsets_ptr, tile_experts_ptr,
    num_experts, N, K,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """out[r] = rows[r] @ weight_e.T for each row r of expert e (rows [R, K], weight_e [N, K], both
    row-major). Program (t, n): row tile t (the tiles of expert 0, then of expert 1, ...), columns
    n * BLOCK_N onwards; tiles past the last expert's run nothing."""
    tile = tl.program_id(0)
    expert = tl.load(tile_experts_ptr + tile)
    if expert < num_experts:
        end_row = tl.load(row_offsets_ptr + expert + 1)
        first_row = tl.load(row_offsets_ptr + expert) + (tile - tl.load(tile_offsets_ptr + expert)) * BLOCK_M
        weight_ptr = tl.load(weight_table_ptr + expert).to(tl.pointer_type(out_ptr.dtype.element_ty))
        offs_m = (first_row + tl.arange(0, BLOCK_M)).to(tl.int64)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        row_in = offs_m < end_row
        column_in = offs_n < N
        accumulator = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(0, K, BLOCK_K):
            k_in = k + offs_k < K
            a = tl.load(rows_ptr + offs_m[:, None] * K + (k + offs_k)[None, :],
                        mask=row_in[:, None] & k_in[None, :], other=0.0)
            w = tl.load(weight_ptr + offs_n[:, None] * K + (k + offs_k)[None, :],
                        mask=column_in[:, None] & k_in[None, :], other=0.0)
            accumulator = tl.dot(a, w.T, accumulator)
        tl.store(out_ptr + offs_m[:, None] * N + offs_n[None, :],
                 accumulator.to(out_ptr.dtype.element_ty), mask=row_in[:, None] & column_in[None, :])


def groupable(weights: list[torch.Tensor], dtype: torch.dtype, device: torch.device) -> bool:
    """The kernel takes these weights: row-major [N, K], all of one shape, bf16 or fp16 `dtype`,
    on `device`."""
    shape = weights[0].shape
    return dtype in (torch.bfloat16, torch.float16) and len(shape) == 2 and all(
        w.dtype == dtype and w.shape == shape and w.is_contiguous() and w.device == device
        for w in weights)


class WeightTable:
    """The experts' weight addresses on the device, remade only when one of them moves. A CUDA
    graph holds the table it was captured with: the weights must stay where they were (the
    engine's weights are updated in place, as for every graphed layer), and the table is made
    before capture, by the warm-up forward."""

    def __init__(self):
        self._addresses: tuple[int, ...] = ()
        self._table: torch.Tensor | None = None

    def __call__(self, weights: list[torch.Tensor]) -> torch.Tensor:
        addresses = tuple(w.data_ptr() for w in weights)
        if addresses != self._addresses:
            if weights[0].is_cuda and torch.cuda.is_current_stream_capturing():
                raise RuntimeError("the experts' weights moved while a CUDA graph is captured: "
                                   "a graph would keep reading the old addresses")
            self._table = torch.tensor(addresses, dtype=torch.int64, device=weights[0].device)
            self._addresses = addresses
        return self._table


def grouped_matmul(rows: torch.Tensor, weight_table: torch.Tensor, weight_shape: torch.Size,
                   rows_per_expert: torch.Tensor) -> torch.Tensor:
    """rows [R, K] grouped by expert (expert 0's rows first; `rows_per_expert` [E] on the device,
    summing to R) times each expert's weight [N, K] transposed: [R, N]. `weight_table` [E] int64:
    the weights' addresses (`WeightTable`). Not differentiable."""
    rows = rows.contiguous()
    (num_rows, k), n = rows.shape, weight_shape[0]
    out = torch.empty((num_rows, n), device=rows.device, dtype=rows.dtype)
    num_experts = rows_per_expert.numel()
    if num_rows == 0 or n == 0:
        return out
    zero = rows_per_expert.new_zeros(1)
    row_offsets = torch.cat([zero, rows_per_expert.cumsum(0)])
    tile_offsets = torch.cat([zero, triton.cdiv(rows_per_expert, BLOCK_M).cumsum(0)])
    # every expert but one may end in a part tile: a bound the host knows without asking the GPU
    tile_bound = triton.cdiv(num_rows, BLOCK_M) + num_experts - 1
    tiles = torch.arange(tile_bound, device=rows.device, dtype=tile_offsets.dtype)
    tile_experts = torch.searchsorted(tile_offsets[1:], tiles, right=True)  # num_experts: no tile
    _grouped_matmul[(tile_bound, triton.cdiv(n, BLOCK_N))](
        rows, weight_table, out, row_offsets, tile_offsets, tile_experts, num_experts, n, k,
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, num_warps=4, num_stages=3,
    )
    return out
