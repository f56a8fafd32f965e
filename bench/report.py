"""What every benchmark shares: the one timer, and the one way a report is shown and written."""

import json
import os
import time

import torch


def seconds(fn, repeats: int) -> float:
    """Mean wall time of `fn` on the GPU after a warm-up call."""
    fn()  # warm-up: compilation, autotuning, allocator growth
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats


def graphed_seconds(fn, repeats: int) -> float:
    """Mean GPU time of `fn` without its launch cost: `repeats` calls captured in one CUDA graph,
    one replay timed with CUDA events (what a call costs inside a graphed decode step)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()  # warm-up outside the graph: compilation, allocator growth
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(repeats):
            fn()
    graph.replay()  # first replay uploads the graph
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / repeats


def write_report(report: dict, summary: dict, path: str | None) -> None:
    """Prints `summary` (the part of `report` a reader wants first) and writes `report` as JSON
    to `path`, if given."""
    print(json.dumps(summary, indent=2))
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump(report, f, indent=2)
