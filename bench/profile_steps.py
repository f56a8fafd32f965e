r"""Where the time goes, in BI and in default mode on the same weights: the generation's time as a
caller sees it (the median wall time of three unsynchronized generations, the GPU done at the end),
the wall time of every engine step of a generation timed alone (synchronized; the first is a
prefill), the same steps unsynchronized (the time between one step's return and the next's, the
pace a caller's loop sees, with whatever host work async scheduling overlaps), the full-batch
decode steps' medians of both (every request admitted and still active: `EngineStepHook`) and
their fraction of the HBM roofline (the bytes each step reads, its requests' contexts counted, over
the device-to-device copy rate measured on the device in the same run, before the model is built),
torch-profiler tables (self CPU and self GPU time per op, per step) of the first PROFILED_STEPS
full-batch decode steps and of a packed trainer forward+backward, a cProfile table of those decode
steps' Python functions (own and cumulative time per step), and the RL update's time (32
generations: packing, logprobs, loss, backward, optimizer step).

  python bench/profile_steps.py <Megatron model flags> --flash-attention-version 4 \
      --bench-output results/profile_dense16_h200.json
"""

import argparse
import os
import statistics
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.report import PythonProfiler, positive_int, python_table, seconds, write_report  # noqa: E402
from bench.workload import (  # noqa: E402
    Workload,
    add_workload_args,
    build_workload,
    check_bi_parity,
    run_modes,
)

from megatron_rl_bi import bi  # noqa: E402
from megatron_rl_bi.config.from_args import model_shape_from_args  # noqa: E402
from megatron_rl_bi.memory import (  # noqa: E402
    ModelShape,
    decode_weight_bytes,
    gdn_state_bytes_per_request,
    kv_bytes_per_token,
)
from megatron_rl_bi.models.build import cpu_state_dict  # noqa: E402

COPY_BYTES = 2**30  # far above the L2 cache (50 MB on an H100 or H200): the copy reads and writes HBM
COPY_REPEATS = 9  # odd: the median is one copy's time
PROFILED_STEPS = 8  # the profilers' window: a generation's first full-batch decode steps
TIMED_GENERATIONS = 3  # the generation time is their median: one host hiccup moves a single run


def add_profile_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    add_workload_args(parser)
    group = parser.add_argument_group("profile")
    group.add_argument("--bench-op-rows", type=positive_int, default=25)
    group.add_argument("--bench-output", default=None)
    group.add_argument("--bench-generation-only", action="store_true",
                       help="the engine alone: no trainer forward+backward, RL update or optimizer "
                            "(the long-response workload, whose trainer the RL run at size times)")
    return parser


class EngineStepHook:
    """Wraps the engine's step. Synchronized, it records each step's wall time alone (the GPU
    idle at its start and done at its end). Unsynchronized, it records the time from the previous
    step's return (the first: from the generation's start) to this one's: what a caller's loop
    sees, with whatever host work of one step overlaps GPU work of the one before.

    A step is a full-batch decode step when at its start every request is active: all were
    admitted, and prefilled, by earlier steps (so it prefills none), and none has finished or been
    paused. These are the steps a decode measurement takes, each with the same requests. Where
    prompts are long, admitting them takes a step or more each, and the first requests finish
    while the last are still prefilled unless a generation has more new tokens than that.
    Synchronized, each one's context tokens (what its attention reads) are counted before it is
    timed. A profiler, when given, runs over the first PROFILED_STEPS of them; `profiled_steps`
    counts them. Steps outside `run` (the bench's rollouts) pass through unrecorded."""

    def __init__(self, engine):
        self.engine, self.step = engine, engine.step_modern
        self.times: list[float] = []
        self.full_batch: list[bool] = []
        self.context_tokens: list[int] = []
        self.profiler, self.synchronize, self.last_return, self.requests = None, True, 0.0, 0
        self.profiled_steps, self.recording = 0, False
        engine.step_modern = self

    def __call__(self, *args, **kwargs):
        if not self.recording:
            return self.step(*args, **kwargs)
        context = self.engine.context
        full_batch = context.get_active_request_count() == self.requests
        if full_batch and self.synchronize:
            self.context_tokens.append(int(context.get_active_sequence_lengths().sum()))
        profiled = full_batch and self.profiler is not None and self.profiled_steps < PROFILED_STEPS
        if profiled and not self.profiled_steps:
            self.profiler.start()
        if self.synchronize:
            torch.cuda.synchronize()
            self.last_return = time.perf_counter()
        result = self.step(*args, **kwargs)
        if self.synchronize:
            torch.cuda.synchronize()
        now = time.perf_counter()
        self.times.append(now - self.last_return)
        self.full_batch.append(full_batch)
        self.last_return = now
        if profiled:
            self.profiled_steps += 1
            if self.profiled_steps == PROFILED_STEPS:
                self.profiler.stop()
        return result

    def run(self, work: Workload, new_tokens: int, profiler=None, synchronize: bool = True) -> list[float]:
        self.times, self.full_batch, self.context_tokens = [], [], []
        self.profiler, self.synchronize, self.requests = profiler, synchronize, len(work.prompts)
        self.profiled_steps, self.last_return, self.recording = 0, time.perf_counter(), True
        try:
            work.generate(new_tokens)
        finally:
            self.recording = False
        if not any(self.full_batch):
            raise RuntimeError(f"no full-batch decode step in {len(self.times)} steps of {new_tokens} new tokens "
                               f"for {self.requests} requests: nothing to measure (give --bench-new-tokens more "
                               "than the steps that admit the requests)")
        if profiler is not None and self.profiled_steps < PROFILED_STEPS:
            profiler.stop()
        return self.times

    def full_batch_times(self) -> list[float]:
        """The last run's full-batch decode steps' times."""
        return [t for t, full in zip(self.times, self.full_batch) if full]


def op_table(profiler, per: int, rows: int) -> dict[str, list[dict]]:
    """The ops with the most self CPU and self GPU time, in ms per step (`per` steps ran)."""
    events = [e for e in profiler.key_averages() if e.key != "ProfilerStep*"]

    def row(e) -> dict:
        return {"op": e.key, "calls_per_step": e.count / per,
                "self_cpu_ms": e.self_cpu_time_total / 1e3 / per,
                "self_gpu_ms": e.self_device_time_total / 1e3 / per}

    by = {"by_self_cpu": "self_cpu_time_total", "by_self_gpu": "self_device_time_total"}
    return {name: [row(e) for e in sorted(events, key=lambda e: getattr(e, key), reverse=True)[:rows]]
            for name, key in by.items()}


def step_time_summary(step_times: list[float]) -> dict:
    """Where a generation's wall time goes beyond its median step: how many engine steps ran,
    their spread, and the slowest ones (index, ms). A sum far above count x median means a few
    steps, not the decode kernels, take the time."""
    ordered = sorted(step_times)
    quantile = lambda q: ordered[min(int(q * len(ordered)), len(ordered) - 1)] * 1e3  # noqa: E731
    slowest = sorted(range(len(step_times)), key=step_times.__getitem__, reverse=True)[:5]
    return {"count": len(step_times), "p50_ms": quantile(0.5), "p90_ms": quantile(0.9),
            "max_ms": ordered[-1] * 1e3, "sum_s": sum(step_times),
            "slowest": [[i, step_times[i] * 1e3] for i in slowest]}


def caller_generations(hook: EngineStepHook, work: Workload,
                       new_tokens: int) -> tuple[float, list[list[float]], list[float]]:
    """TIMED_GENERATIONS unsynchronized generations, as a caller runs them: their median wall time
    (from the GPU idle to the GPU done), each one's step intervals, and their full-batch decode
    steps' intervals."""
    walls, intervals, full_batch = [], [], []
    for _ in range(TIMED_GENERATIONS):
        torch.cuda.synchronize()
        start = time.perf_counter()
        intervals.append(hook.run(work, new_tokens, synchronize=False))
        torch.cuda.synchronize()
        walls.append(time.perf_counter() - start)
        full_batch += hook.full_batch_times()
    return statistics.median(walls), intervals, full_batch


def decode_bytes(shape: ModelShape, requests: int, context_tokens: int) -> int:
    """HBM bytes a full-batch decode step of `requests` must read: the weights (less the input
    embedding, of which a step reads a row per request, when untied), the attention KV cache of its
    `context_tokens` (the requests' contexts, summed), and each GDN layer's states (conv and fp32
    rule, read and written)."""
    return (decode_weight_bytes(shape) + kv_bytes_per_token(shape) * context_tokens
            + 2 * requests * gdn_state_bytes_per_request(shape))


def copy_rate(copy_bytes: int, copy_seconds: list[float]) -> float:
    """Bytes a second of copies of `copy_bytes`, each read and written (2 x), at the copies' median
    time: one copy slowed by something else on the machine does not move it."""
    return 2 * copy_bytes / statistics.median(copy_seconds)


def measure_copy_rate() -> float:
    """The current CUDA device's HBM roofline: COPY_REPEATS device-to-device copies of COPY_BYTES
    after a warm-up, each timed with CUDA events. The buffers are freed and given back to the
    device before the model is built, so the model and its KV cache find the memory as before.
    An H200 measured 4.3e12 bytes a second by a device-to-device copy (its datasheet: 4.8e12): the
    constant roofline of the files made before each run measured its own."""
    source = torch.empty(COPY_BYTES, dtype=torch.uint8, device="cuda")
    destination = torch.empty_like(source)
    destination.copy_(source)  # warm-up
    copy_seconds = []
    for _ in range(COPY_REPEATS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        destination.copy_(source)
        end.record()
        end.synchronize()
        copy_seconds.append(start.elapsed_time(end) / 1e3)
    del source, destination
    torch.cuda.empty_cache()
    return copy_rate(COPY_BYTES, copy_seconds)


def roofline_fraction(step_bytes: list[float], step_seconds: list[float], copy_bytes_per_s: float) -> float:
    """The steps' median bytes read a second, as a fraction of the device's copy rate."""
    return statistics.median(b / t for b, t in zip(step_bytes, step_seconds)) / copy_bytes_per_s


def trainer_times(args, work: Workload) -> dict:
    """The packed trainer forward+backward, the RL update on the bench's rollouts, and the
    forward+backward's op table."""
    train_s = seconds(work.train_step, 3)
    rollouts = work.rollouts(args.bench_new_tokens)
    update_s = seconds(lambda: work.rl_update(rollouts), 3)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as train_profile:
        work.train_step()
        torch.cuda.synchronize()
    return {"train_fwd_bwd_s": train_s, "rl_update_s": update_s,
            "train_ops": op_table(train_profile, 1, args.bench_op_rows)}


def measure(args, batch_invariant: bool, weights) -> tuple[dict, dict]:
    copy_bytes_per_s = measure_copy_rate()  # before the model and its cache take the memory
    with bi.batch_invariant(batch_invariant):
        work = build_workload(args, weights, trains=not args.bench_generation_only)
        hook = EngineStepHook(work.generator.engine)
        hook.run(work, args.bench_new_tokens)  # warm-up
        step_times = hook.run(work, args.bench_new_tokens)
        shape = model_shape_from_args(args, args.bench_vocab_size)
        decode_times = hook.full_batch_times()
        step_bytes = [decode_bytes(shape, len(work.prompts), n) for n in hook.context_tokens]
        generate_s, paced_runs, paced_decode = caller_generations(hook, work, args.bench_new_tokens)
        decode_profile = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
        hook.run(work, args.bench_new_tokens, decode_profile)
        profiled_decode_steps = hook.profiled_steps
        python_profile = PythonProfiler()
        hook.run(work, args.bench_new_tokens, python_profile, synchronize=False)
        result = {
            "generate_s": generate_s,
            "engine_steps": step_time_summary(step_times),
            "engine_steps_unsynchronized": step_time_summary(paced_runs[0]),
            "prefill_ms": step_times[0] * 1e3,
            "decode_steps": len(decode_times),
            "decode_step_ms_median": statistics.median(decode_times) * 1e3,
            "decode_interval_ms_median": statistics.median(paced_decode) * 1e3,
            "decode_tokens_per_s": len(work.prompts) / statistics.median(paced_decode),  # the pace a caller gets
            "decode_bytes_per_step": statistics.median(step_bytes),
            "decode_hbm_roofline_fraction": roofline_fraction(step_bytes, decode_times, copy_bytes_per_s),
            "hbm_copy_bytes_per_s": copy_bytes_per_s,
            "decode_ops": op_table(decode_profile, profiled_decode_steps, args.bench_op_rows),
            "decode_ops_steps": profiled_decode_steps,
            "decode_python": python_table(python_profile, hook.profiled_steps, args.bench_op_rows),
            "decode_python_steps": hook.profiled_steps,
            "parity_max": work.parity_max(),
        }
        if work.trains:
            result.update(trainer_times(args, work))
        state = cpu_state_dict(work.model)
    return result, state


def main() -> None:
    args, report = run_modes(add_profile_args, measure)
    keys = ("prefill_ms", "decode_step_ms_median", "decode_interval_ms_median", "decode_hbm_roofline_fraction",
            "hbm_copy_bytes_per_s", "train_fwd_bwd_s", "parity_max")
    write_report(report, {mode: {k: report[mode].get(k) for k in keys} for mode in ("bi", "default") if mode in report},
                 args.bench_output)
    check_bi_parity(report)


if __name__ == "__main__":
    main()
