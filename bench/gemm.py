"""The BI GEMM against cuBLAS and megatron-core's `matmul_persistent`, per shape and layout
(bf16), as time ratios within one run: our TMA kernel (what BI mode runs), eager and at decode
sizes graphed; and whether its bits equal megatron-core's (if they do, the swap leaves every BI
result file unchanged).

  python bench/gemm.py --output results/bench_gemm_h200.json
"""

import argparse
import dataclasses
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.report import graphed_seconds, positive_int, seconds, write_report  # noqa: E402

from megatron_rl_bi.bi import gemm  # noqa: E402
from megatron_rl_bi.reporting.provenance import provenance  # noqa: E402

# (M, K, N, layout): trainer shapes (16K tokens: QKV, FFN, output layer; forward x @ W.T, input
# gradient dY @ W, weight gradient dY.T @ X) and decode shapes (32-64 rows; the 16-layer dense bench
# model's QKV, output, MLP and LM-head products at 32 requests among them, and Qwen3-4B's at the 64
# requests its recipe's engine runs: few output columns over a long K leave SMs idle).
SHAPES = [(8192, 2048, 8192, "forward"), (16384, 2048, 3072, "forward"),
          (16384, 2048, 12288, "forward"), (16384, 6144, 2048, "forward"),
          (16384, 2048, 151936, "forward"), (16384, 6144, 2048, "input_gradient"),
          (6144, 16384, 2048, "weight_gradient"), (2048, 16384, 12288, "weight_gradient"),
          (64, 4096, 12288, "forward"), (32, 2048, 3072, "forward"), (32, 2048, 2048, "forward"),
          (32, 2048, 151936, "forward"), (32, 2048, 4096, "forward"), (32, 2048, 12288, "forward"),
          (32, 6144, 2048, "forward"), (64, 2560, 6144, "forward"), (64, 4096, 2560, "forward"),
          (64, 2560, 19456, "forward"), (64, 9728, 2560, "forward")]
# Tiles tried at decode sizes (M <= 64), timed inside a CUDA graph; the bits must not change. A
# decode product streams the weight once from fewer programs than the GPU has SMs, so wider K
# blocks and deeper pipelines (more of the weight in flight per program) are tried too, within
# ~200 KiB of shared memory for the pipeline's A and B tiles.
DECODE_TILES = [gemm.TileConfig(64, n, stages, 4, k) for n in (32, 64, 128)
                for k, stages in ((64, 4), (64, 6), (64, 8), (128, 3), (128, 4), (128, 6), (256, 3))
                if stages * (64 + n) * k * 2 <= 200 * 1024] + [gemm.TileConfig(64, 256, 3, 8)]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=positive_int, default=20)
    parser.add_argument("--output", default=None)
    return parser


def operands(m: int, k: int, n: int, layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A [M, K] and B [K, N] laid out as the layer's product has them: forward x @ W.T (B is a
    transposed weight), input gradient dY @ W, weight gradient dY.T @ X (A is transposed)."""
    torch.manual_seed(0)
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
    if layout == "forward":
        b = b.T.contiguous().T
    elif layout == "weight_gradient":
        a = a.T.contiguous().T
    return a, b


def decode_tiles(a: torch.Tensor, b: torch.Tensor, repeats: int) -> list[dict]:
    reference = gemm.MCORE_MATMUL(a, b)
    return [{**dataclasses.asdict(t),
             "graphed_ms": graphed_seconds(lambda t=t: gemm.matmul(a, b, config=t), repeats) * 1e3,
             "bits_equal_mcore": torch.equal(gemm.matmul(a, b, config=t), reference)}
            for t in DECODE_TILES]


def graphed(a: torch.Tensor, b: torch.Tensor, kernels: dict, repeats: int) -> dict:
    """Decode sizes as a graphed step pays them (GPU time only; BI mode runs ours there)."""
    times = {f"{name}_graphed_ms": graphed_seconds(kernels[name], repeats) * 1e3
             for name in ("cublas", "mcore_persistent", "ours")}
    return {**times,
            "ours_graphed_over_cublas": times["ours_graphed_ms"] / times["cublas_graphed_ms"],
            "mcore_graphed_over_cublas": times["mcore_persistent_graphed_ms"] / times["cublas_graphed_ms"],
            "decode_tiles": decode_tiles(a, b, repeats)}


def measure(m: int, k: int, n: int, layout: str, repeats: int) -> dict:
    """Eager times (launch included, as an eager step pays it) of cuBLAS, megatron-core's kernel
    and ours; at decode sizes (M <= 64) also graphed times."""
    a, b = operands(m, k, n, layout)
    kernels = {"cublas": lambda: a @ b, "mcore_persistent": lambda: gemm.MCORE_MATMUL(a, b),
               "ours": lambda: gemm.matmul(a, b)}
    times = {f"{name}_ms": seconds(fn, repeats) * 1e3 for name, fn in kernels.items()}
    return {
        "shape_mkn": [m, k, n],
        "layout": layout,
        **times,
        "ours_over_cublas": times["ours_ms"] / times["cublas_ms"],
        "mcore_over_cublas": times["mcore_persistent_ms"] / times["cublas_ms"],
        "bits_equal_mcore": torch.equal(gemm.matmul(a, b), gemm.MCORE_MATMUL(a, b)),
        **(graphed(a, b, kernels, repeats) if m <= 64 else {}),
    }


def main() -> None:
    args = build_parser().parse_args()
    rows = [measure(m, k, n, layout, args.repeats) for m, k, n, layout in SHAPES]
    report = {**provenance(), "shapes": rows}
    summary = {f"{r['shape_mkn']} {r['layout']}": {k: (round(v, 3) if isinstance(v, float) else v)
                                                   for k, v in r.items() if k.endswith(("over_cublas", "mcore"))}
               for r in rows}
    write_report(report, summary, args.output)


if __name__ == "__main__":
    main()
