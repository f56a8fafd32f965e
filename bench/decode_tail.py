"""What a graphed decode step runs outside its graph, and what BI mode adds there: the LM head's
product and the log-softmax of the log-probs at 32 requests, for the bench models' two vocabularies.
Per call: the host's time to launch it (the GPU kept busy by a sleep kernel queued first, so no
launch waits for the GPU), the GPU's time (CUDA events around the same queued calls) and a cProfile
table of the host's Python functions. Where the host paces a step (dense4), the host column is
what BI costs; where the GPU does, the GPU column.

  python bench/decode_tail.py --output results/bench_decode_tail_h200.json
"""

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.report import PythonProfiler, positive_int, python_table, write_report  # noqa: E402

from megatron_rl_bi import bi  # noqa: E402
from megatron_rl_bi.bi import gemm, log_softmax  # noqa: E402
from megatron_rl_bi.reporting.provenance import provenance  # noqa: E402

REQUESTS, HIDDEN = 32, 2048
VOCABS = {"dense4": 32000, "dense16 / hybrid24": 151936}
SLEEP_CYCLES = 200_000_000  # ~0.1 s of one SM at ~2 GHz: longer than any loop of calls below takes to launch


def _sleep_ms() -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(SLEEP_CYCLES)
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def host_and_gpu_us(fn, calls: int) -> dict:
    """`calls` calls of `fn` queued behind a sleep kernel: host microseconds a call to launch them,
    GPU microseconds a call to run them, and whether the GPU was still asleep when the host was done
    (if not, a launch may have waited for the GPU and the host time is an upper bound)."""
    fn()  # warm-up: compilation, allocator growth
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(SLEEP_CYCLES)
    start.record()
    begin = time.perf_counter()
    for _ in range(calls):
        fn()
    host_s = time.perf_counter() - begin
    end.record()
    torch.cuda.synchronize()
    return {"host_us": host_s / calls * 1e6, "gpu_us": start.elapsed_time(end) / calls * 1e3,
            "gpu_busy_throughout": host_s * 1e3 < _sleep_ms()}


def python_profile(fn, calls: int, rows: int = 10) -> list[dict]:
    """Where a call's host time goes, by Python function (cProfile adds its own cost per call)."""
    profiler = PythonProfiler()
    profiler.start()
    for _ in range(calls):
        fn()
    profiler.stop()
    torch.cuda.synchronize()
    return python_table(profiler, calls, rows)


def variants(vocab: int) -> dict:
    """Each variant as (batch-invariant mode on, the call). Inputs as the engine has them: bf16
    hidden states times the transposed LM-head weight; fp32 logits."""
    torch.manual_seed(0)
    hidden = torch.randn(REQUESTS, HIDDEN, device="cuda", dtype=torch.bfloat16)
    weight_t = torch.randn(vocab, HIDDEN, device="cuda", dtype=torch.bfloat16).T
    logits = torch.randn(REQUESTS, vocab, device="cuda", dtype=torch.float32)
    split_parts = log_softmax.programs_per_row(REQUESTS, gemm.streaming_multiprocessors(logits.device))
    return {
        "lm_head default (cuBLAS)": (False, lambda: torch.mm(hidden, weight_t)),
        "lm_head BI mode": (True, lambda: torch.mm(hidden, weight_t)),
        "lm_head megatron-core kernel": (True, lambda: gemm.MCORE_MATMUL(hidden, weight_t)),
        "lm_head TMA kernel": (True, lambda: gemm.matmul(hidden, weight_t)),
        "log_softmax default": (False, lambda: torch.log_softmax(logits, dim=-1)),
        "log_softmax BI mode": (True, lambda: torch.log_softmax(logits, dim=-1)),
        "log_softmax megatron-core kernel": (True, lambda: log_softmax.MCORE_LOG_SOFTMAX(logits, dim=-1)),
        "log_softmax split rows": (True, lambda: log_softmax.split_rows_log_softmax(logits, split_parts)),
    }


def build_parser(description: str = __doc__, calls: int = 100) -> argparse.ArgumentParser:
    """--calls and --output, the options of the benches that time queued calls (this one, rope.py)."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=positive_int, default=calls, help="calls of each variant queued behind one sleep")
    parser.add_argument("--output", default=None)
    return parser


def main() -> None:
    args = build_parser().parse_args()
    rows = []
    for model, vocab in VOCABS.items():
        for name, (batch_invariant, fn) in variants(vocab).items():
            with bi.batch_invariant(batch_invariant):
                rows.append({"models": model, "vocab": vocab, "variant": name,
                             **host_and_gpu_us(fn, args.calls), "python": python_profile(fn, args.calls)})
    summary = {f"{r['vocab']} {r['variant']}": f"host {r['host_us']:.1f} us, GPU {r['gpu_us']:.1f} us"
               + ("" if r["gpu_busy_throughout"] else " (GPU idle before the host was done)") for r in rows}
    write_report({**provenance(), "requests": REQUESTS, "hidden": HIDDEN, "calls": args.calls, "rows": rows},
                 summary, args.output)


if __name__ == "__main__":
    main()
