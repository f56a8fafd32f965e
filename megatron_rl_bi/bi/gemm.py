"""The batch-invariant GEMM behind aten::mm and aten::addmm in BI mode (bf16/fp16).

megatron-core's `matmul_persistent` is batch-invariant but slow on the H200: 1.3-1.5x cuBLAS's time
on row-major training shapes, ~4x over a whole forward+backward (pointer loads of the transposed
operands; bench/gemm.py, results/bench_h200.json). This kernel is persistent too, and loads its
tiles with TMA (out-of-bounds zero-filled, so no masks). Each program writes its tensor descriptors
on the GPU. Encoded on the host, they made an eager 32-row product cost 91-103 us a call against
39-79 us (bench/gemm.py on the H200, launch-bound), more than megatron-core's kernel (54-74 us), so
such products, an LM head at 32 requests among them, went to that kernel and its 3x GPU time; the
price is ~3 us of GPU per product inside a graphed decode step (results/README.md). What keeps an
output row's bits independent of how many rows run with it: no split-K, and K reduced in order in
block_k steps into one fp32 accumulator per tile (the MMA instructions accumulate 16 K values at a
time in K order whatever the block). The tile sizes are picked by M and N (small tiles for
decode-sized M); on the H200 the bits were found not to depend on the M/N tile, and to equal
megatron-core's kernel's (the same fp32 accumulation in K order): tests/gpu test_bi_gemm checks
every config and every layout, bench/gemm.py every decode tile it tries. fp32 inputs, and tensors
TMA cannot describe (a 16-byte-misaligned base or stride, the output's included: N not a multiple
of 8 in bf16), go to megatron-core's kernel.
"""

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from megatron.core.transformer.custom_layers import batch_invariant_kernels as _mcore_bik

GROUP_M = 8
_TMA_ALIGNMENT_BYTES = 16
MCORE_MATMUL = _mcore_bik.matmul_persistent


@dataclass(frozen=True)
class TileConfig:
    block_m: int
    block_n: int
    num_stages: int
    num_warps: int
    block_k: int = 64


# (largest M, smallest N, config), first match wins; every config reduces K the same way.
# Decode-sized M takes narrow N tiles and long K steps: a memory-bound product needs many programs
# streaming the weight, each with few, large loads in flight. Graphed on the H200 (bench/gemm.py's
# decode sweep, results/bench_gemm_h200.json, all 20 tiles bit-identical): N >= 65,536 (the LM head)
# 64x256 0.160 ms against 64x128's 0.168; N >= 8,192 64x128 with K steps of 128 0.027 ms at
# 64x4096x12288 against 0.032; below that 64x64 with K steps of 256 0.0067-0.0077 ms against
# 0.0076-0.0086 at K = 2048.
TILE_CONFIGS = (
    (64, 65536, TileConfig(64, 256, 3, 8)),
    (64, 8192, TileConfig(64, 128, 4, 4, block_k=128)),
    (64, 0, TileConfig(64, 64, 3, 4, block_k=256)),
    (256, 0, TileConfig(128, 128, 4, 8)),
    (None, 0, TileConfig(128, 256, 3, 8)),
)


def tile_config(m: int, n: int) -> TileConfig:
    return next(config for max_m, min_n, config in TILE_CONFIGS
                if (max_m is None or m <= max_m) and n >= min_n)


@triton.jit
def _tile_coordinates(tile, num_m, num_n, GROUP_M: tl.constexpr):
    """Tiles in groups of GROUP_M row blocks, so neighbouring programs share B tiles in L2."""
    tiles_per_group = GROUP_M * num_n
    first_m = (tile // tiles_per_group) * GROUP_M
    group_rows = min(num_m - first_m, GROUP_M)
    return first_m + (tile % tiles_per_group) % group_rows, (tile % tiles_per_group) // group_rows


@triton.jit
def _row_major_descriptor(ptr, rows, cols, row_stride, BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr):
    return tl.make_tensor_descriptor(ptr, shape=[rows, cols], strides=[row_stride, 1],
                                     block_shape=[BLOCK_ROWS, BLOCK_COLS])


# Triton compiles a variant for each integer argument that is 1, a multiple of 16, or neither; the
# tiny hybrid recipe's fresh run compiled 25. Those below only bound loops and describe tensors to
# TMA: unspecialized, every tile compiles to the machine code it has with all of them multiples of
# 16 (CPU test). N stays: a multiple of 16 lets the bias epilogue vectorize its masked load.
@triton.jit(do_not_specialize=["M", "K", "a_row_stride", "b_row_stride", "num_programs"])
def _persistent_matmul(
    a_ptr, b_ptr, c_ptr, bias_ptr, M, N, K, a_row_stride, b_row_stride, num_programs,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    A_COLUMN_MAJOR: tl.constexpr, B_COLUMN_MAJOR: tl.constexpr, HAS_BIAS: tl.constexpr,
):
    """C[M, N] = A[M, K] @ B[K, N] (+ bias[N]). A column-major A is passed and described as its
    row-major [K, M] transpose, a column-major B as its [N, K] transpose."""
    if A_COLUMN_MAJOR:
        a_desc = _row_major_descriptor(a_ptr, K, M, a_row_stride, BLOCK_K, BLOCK_M)
    else:
        a_desc = _row_major_descriptor(a_ptr, M, K, a_row_stride, BLOCK_M, BLOCK_K)
    if B_COLUMN_MAJOR:
        b_desc = _row_major_descriptor(b_ptr, N, K, b_row_stride, BLOCK_N, BLOCK_K)
    else:
        b_desc = _row_major_descriptor(b_ptr, K, N, b_row_stride, BLOCK_K, BLOCK_N)
    c_desc = _row_major_descriptor(c_ptr, M, N, N, BLOCK_M, BLOCK_N)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    for tile in tl.range(tl.program_id(0), num_m * num_n, num_programs):
        pid_m, pid_n = _tile_coordinates(tile, num_m, num_n, GROUP_M)
        off_m, off_n = pid_m * BLOCK_M, pid_n * BLOCK_N
        accumulator = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(0, K, BLOCK_K):
            if A_COLUMN_MAJOR:
                a = a_desc.load([k, off_m]).T
            else:
                a = a_desc.load([off_m, k])
            if B_COLUMN_MAJOR:
                b = b_desc.load([off_n, k]).T
            else:
                b = b_desc.load([k, off_n])
            accumulator = tl.dot(a, b, accumulator)
        if HAS_BIAS:
            offs_n = off_n + tl.arange(0, BLOCK_N)
            accumulator += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
        c_desc.store([off_m, off_n], accumulator.to(c_ptr.dtype.element_ty))


def _descriptor_scratch(size: int, alignment: int, stream: int | None) -> torch.Tensor:
    """Global memory where each program writes its tensor descriptors (Triton asks at launch)."""
    return torch.empty(size, device="cuda", dtype=torch.int8)


def _tma_view(t: torch.Tensor) -> tuple[torch.Tensor, bool] | None:
    """`t` [R, C] as a row-major tensor TMA can describe: (t, False) or, for a column-major t,
    (t.T, True); a copy when t is neither; None when the base or a stride is misaligned."""
    if t.stride(1) == 1 and t.stride(0) >= t.shape[1]:
        view, column_major = t, False
    elif t.stride(0) == 1 and t.stride(1) >= t.shape[0]:
        view, column_major = t.T, True
    else:
        view, column_major = t.contiguous(), False
    aligned = (view.data_ptr() % _TMA_ALIGNMENT_BYTES == 0
               and view.stride(0) * view.element_size() % _TMA_ALIGNMENT_BYTES == 0)
    return (view, column_major) if aligned else None


@functools.cache  # asked at every BI GEMM and log-softmax launch; torch's lookup costs host time
def streaming_multiprocessors(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # the Triton interpreter (CPU tests)


def matmul(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None,
           config: TileConfig | None = None) -> torch.Tensor:
    """a [M, K] @ b [K, N] (+ bias [N]) in a's dtype, each row computed the same way for any M.
    `config` overrides the tile picked by M and N (the tests run every config)."""
    if a.dtype != b.dtype or a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0]:
        raise ValueError(f"matmul of {tuple(a.shape)} {a.dtype} and {tuple(b.shape)} {b.dtype}")
    (m, k), n = a.shape, b.shape[1]
    c = torch.empty((m, n), device=a.device, dtype=a.dtype)
    if m == 0 or n == 0:
        return c
    if k == 0:
        return c.zero_() if bias is None else c.copy_(bias.expand(m, n))
    a_view, b_view = _tma_view(a), _tma_view(b)
    c_aligned = n * c.element_size() % _TMA_ALIGNMENT_BYTES == 0
    if a.dtype not in (torch.bfloat16, torch.float16) or a_view is None or b_view is None or not c_aligned:
        return MCORE_MATMUL(a, b, bias)
    config = config or tile_config(m, n)
    (a_tma, a_column_major), (b_tma, b_column_major) = a_view, b_view
    tiles = triton.cdiv(m, config.block_m) * triton.cdiv(n, config.block_n)
    programs = min(streaming_multiprocessors(a.device), tiles)
    triton.set_allocator(_descriptor_scratch)  # a context variable: set where the launch runs
    _persistent_matmul[(programs,)](
        a_tma, b_tma, c, bias, m, n, k, a_tma.stride(0), b_tma.stride(0), programs,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, GROUP_M=GROUP_M,
        A_COLUMN_MAJOR=a_column_major, B_COLUMN_MAJOR=b_column_major, HAS_BIAS=bias is not None,
        num_stages=config.num_stages, num_warps=config.num_warps,
    )
    return c
