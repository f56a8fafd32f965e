"""The BI GEMM against cuBLAS and megatron-core's `matmul_persistent`, per shape (bf16), as
time ratios within one run; and whether its bits equal megatron-core's kernel's (if they do,
swapping kernels leaves every BI result file unchanged).

  python bench/gemm.py --output results/bench_gemm_h200.json
"""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.report import seconds, write_report  # noqa: E402

from megatron_rl_bi.bi import gemm  # noqa: E402
from megatron_rl_bi.reporting.provenance import provenance  # noqa: E402

# (M, K, N): trainer shapes (16K tokens: QKV, FFN, output layer) and decode shapes (32-64 rows).
SHAPES = [(8192, 2048, 8192), (16384, 2048, 3072), (16384, 2048, 12288), (16384, 6144, 2048),
          (16384, 2048, 151936), (64, 4096, 12288), (32, 2048, 3072), (32, 2048, 151936)]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--output", default=None)
    return parser


def measure(m: int, k: int, n: int, repeats: int) -> dict:
    torch.manual_seed(0)
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)  # x @ W.T, as a linear layer
    times = {
        "cublas_ms": seconds(lambda: a @ weight.T, repeats) * 1e3,
        "mcore_persistent_ms": seconds(lambda: gemm._MCORE_MATMUL(a, weight.T), repeats) * 1e3,
        "ours_ms": seconds(lambda: gemm.matmul(a, weight.T), repeats) * 1e3,
    }
    return {
        "shape_mkn": [m, k, n],
        **times,
        "ours_over_cublas": times["ours_ms"] / times["cublas_ms"],
        "mcore_over_cublas": times["mcore_persistent_ms"] / times["cublas_ms"],
        "bits_equal_mcore": torch.equal(gemm.matmul(a, weight.T), gemm._MCORE_MATMUL(a, weight.T)),
    }


def main() -> None:
    args = build_parser().parse_args()
    rows = [measure(m, k, n, args.repeats) for m, k, n in SHAPES]
    report = {**provenance(), "shapes": rows}
    summary = {f"{r['shape_mkn']}": {k: (round(v, 3) if isinstance(v, float) else v)
                                     for k, v in r.items() if k != "shape_mkn"} for r in rows}
    write_report(report, summary, args.output)


if __name__ == "__main__":
    main()
