"""What every benchmark shares: the timers, the Python profile table, and the one way a report is
shown and written."""

import argparse
import cProfile
import json
import os
import pstats
import time

import torch


def positive_int(text: str) -> int:
    """argparse type of the benches' counts: a count of 0 would time nothing and report it."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value}: must be >= 1")
    return value


def seconds(fn, repeats: int) -> float:
    """Mean wall time of `fn` on the GPU after a warm-up call."""
    fn()  # warm-up: compilation, autotuning, allocator growth
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats


def peak_bytes(fn) -> int:
    """GPU memory `fn` allocates at its peak above what was allocated before it, in bytes (its
    workspace: what stays allocated after it is included)."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before


def peak_mib(fn) -> float:
    """peak_bytes in MiB."""
    return peak_bytes(fn) / 2**20


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


class PythonProfiler:
    """cProfile behind the torch profiler's start/stop, so EngineStepHook takes either."""

    def __init__(self):
        self.profile = cProfile.Profile()

    def start(self):
        self.profile.enable()

    def stop(self):
        self.profile.disable()


def python_table(profiler: PythonProfiler, per: int, rows: int) -> list[dict]:
    """The Python functions with the most own time (tottime), in ms per step or call (`per` of them
    ran), with their cumulative time: where the host time goes, below the op level."""
    stats = pstats.Stats(profiler.profile).stats
    top = sorted(stats.items(), key=lambda item: item[1][2], reverse=True)[:rows]
    return [{"function": f"{short_path(path)}:{line}({name})", "calls_per_step": calls / per,
             "own_ms": own * 1e3 / per, "cumulative_ms": cumulative * 1e3 / per}
            for (path, line, name), (_, calls, own, cumulative, _) in top]


def short_path(path: str) -> str:
    """An installed package's or this package's source path from the package down."""
    if "site-packages/" in path:
        return path.rsplit("site-packages/", 1)[1]
    if "megatron_rl_bi/" in path:
        return "megatron_rl_bi/" + path.rsplit("megatron_rl_bi/", 1)[1]
    return path


def write_json(value: dict, path: str) -> None:
    """`value` as JSON at `path`, whole or not at all: written beside it, then moved over it, so a
    bench stopped mid-write (a device call's time limit) leaves the file it wrote before intact."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    partial = f"{path}.partial"
    with open(partial, "w") as f:
        json.dump(value, f, indent=2)
    os.replace(partial, path)


def write_report(report: dict, summary: dict, path: str | None) -> None:
    """Prints `summary` (the part of `report` a reader wants first) and writes `report` as JSON
    to `path`, if given."""
    print(json.dumps(summary, indent=2))
    if path:
        write_json(report, path)
