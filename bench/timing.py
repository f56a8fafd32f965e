"""The one timer of the benchmarks: mean wall time of `fn` on the GPU after a warm-up call."""

import time

import torch


def seconds(fn, repeats: int) -> float:
    fn()  # warm-up: compilation, autotuning, allocator growth
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats
