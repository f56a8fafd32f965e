r"""Time to the first step, with empty compile caches (a fresh machine) and with the caches that run
filled (a warm one): the run's whole wall time, the time until its first step's record is written,
the start-up's phases before it, and the first step's phases against the median of its later
steps; the Triton compilations its records count (up to and in the first step, and after it), and
after the fresh run, the kernels in the round's Triton cache with their compiled variants and
FlashAttention-4's compiled kernels by family. Each
round runs the command twice on one new cache directory (Triton's kernels and autotuning picks,
TorchInductor's, CUTLASS DSL's (FlashAttention-4), the CUDA JIT's, and TMPDIR/XDG_CACHE_HOME, where
the rest keep theirs): first empty, then filled. The ratios are the rounds' medians. A fresh
machine's caches, not its file cache: the libraries' files are read from memory in both runs.

  python bench/first_step.py --output results/bench_first_step_hybrid_h200.json -- \
      --recipe examples/recipes/tiny_sort_hybrid.yaml --batch-invariant-mode \
      --flash-attention-version 4 --train-iters 24

With --profile DIR each run runs under cProfile, and each round prints the functions whose
cumulative seconds grew most from the warm run to the fresh one: where the empty caches' seconds
go (the report then says "profiled": its times are not to be set beside unprofiled ones).
"""

import argparse
import collections
import os
import pstats
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.report import positive_int, write_report  # noqa: E402

from megatron_rl_bi.reporting.metrics import read_step_records  # noqa: E402
from megatron_rl_bi.reporting.provenance import provenance  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CACHE_VARIABLES = ("TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR", "CUTE_DSL_CACHE_DIR", "CUDA_CACHE_PATH",
                   "XDG_CACHE_HOME", "TMPDIR")
PHASES = ("time/step_s", "time/generation_s", "time/training_s", "time/optimizer_s")
# Before the first step (its record carries them): the process's start to main's (the imports),
# main's start to the model and optimizer built, compile ahead and of it the wait for its workers,
# the engine's build, the SFT warm-up (absent without one)
STARTUP = ("time/startup_imports_s", "time/startup_model_s", "time/startup_compile_ahead_s",
           "time/startup_compile_ahead_wait_s", "time/startup_engine_s", "time/startup_sft_s")
# Where the empty caches' compiles fall: compile ahead (its wait a part of it), the SFT warm-up and
# the first step (PHASES' step_s); the imports and the later steps compile nothing, and what they
# add to the whole run's difference is the runs' own spread
COMPILING_STARTUP = ("time/startup_compile_ahead_s", "time/startup_sft_s")
# Triton's compilations since the record before (each step record carries them)
COMPILES = ("time/triton_compiles", "time/triton_compile_s", "time/triton_cache_loads")
# Compile ahead's workers (the first record, where the pass ran): their jobs, their compiling summed
COMPILE_AHEAD = ("compile_ahead/jobs", "time/compile_ahead_workers_s")
POLL_SECONDS = 0.2


def cache_paths(cache_dir: str) -> dict[str, str]:
    """Each cache variable's directory under `cache_dir`."""
    return {name: os.path.join(cache_dir, name.lower()) for name in CACHE_VARIABLES}


def cache_environment(cache_dir: str) -> dict[str, str]:
    """The environment of a run whose compile caches all live under `cache_dir`."""
    paths = cache_paths(cache_dir)
    for path in paths.values():
        os.makedirs(path, exist_ok=True)
    return {**os.environ, **paths}


def triton_kernels(cache_dir: str) -> dict[str, int]:
    """The kernels in Triton's cache under `cache_dir`, each with its number of compiled variants
    (one binary per specialization: shapes' divisibility, constants, config), the most first."""
    found = collections.Counter(name.removesuffix(".cubin")
                                for _, _, names in os.walk(cache_paths(cache_dir)["TRITON_CACHE_DIR"])
                                for name in names if name.endswith(".cubin"))
    return dict(found.most_common())


def flash_attention_kernels(cache_dir: str) -> dict[str, int]:
    """FlashAttention-4's compiled kernels in its disk cache under `cache_dir` (it keeps it under
    TMPDIR: <user>/flash_attention_cute_dsl_cache/<source fingerprint>/<family>/<key>.o), counted
    by family (fwd, bwd, bwd_pre, ...), the most first."""
    found = collections.Counter(os.path.basename(directory)
                                for directory, _, names in os.walk(cache_paths(cache_dir)["TMPDIR"])
                                if "flash_attention_cute_dsl_cache" in directory.split(os.sep)
                                for name in names if name.endswith(".o") and not name.startswith("."))
    return dict(found.most_common())


def _step_lines(metrics: str) -> int:
    """How many step records `metrics` holds so far (0 before the file exists)."""
    if not os.path.exists(metrics):
        return 0
    with open(metrics) as f:
        return sum(line.startswith('{"step"') for line in f)


def _record_seconds(metrics: str, process: subprocess.Popen, start: float) -> tuple[float | None, float | None]:
    """Seconds from `start` until `metrics` first holds a step record, and until its last one
    appeared (to within a poll; None for both if the process wrote none)."""
    first = last = None
    seen = 0
    while True:
        running = process.poll() is None
        count = _step_lines(metrics)
        if count > seen:
            seen, last = count, time.perf_counter() - start
            first = last if first is None else first
        if not running:
            return first, last
        time.sleep(POLL_SECONDS)


def run_command(flags: list[str], work_dir: str, profile: str | None = None) -> list[str]:
    """pretrain_rl.py with `flags` under torchrun, its records and checkpoints in `work_dir`;
    under cProfile, writing to `profile`, when given."""
    profiled = ["-m", "cProfile", "-o", profile] if profile else []
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1", *profiled,
            os.path.join(REPO, "pretrain_rl.py"), *flags, "--rl-metrics-jsonl", os.path.join(work_dir, "metrics.jsonl"),
            "--save", os.path.join(work_dir, "checkpoints")]


def run_once(flags: list[str], cache_dir: str, work_dir: str, profile: str | None = None) -> dict:
    """One run of pretrain_rl.py with `flags` on the caches under `cache_dir` (profiled into
    `profile` when given)."""
    metrics = os.path.join(work_dir, "metrics.jsonl")
    if os.path.exists(metrics):
        os.remove(metrics)
    command = run_command(flags, work_dir, profile)
    start = time.perf_counter()
    process = subprocess.Popen(command, env=cache_environment(cache_dir), cwd=REPO)
    first_record_s, last_record_s = _record_seconds(metrics, process, start)
    if process.wait() != 0:
        raise SystemExit(f"first_step.py: the run exited {process.returncode}: {' '.join(command)}")
    if first_record_s is None:
        raise SystemExit(f"first_step.py: the run wrote no step record to {metrics}: {' '.join(command)}")
    wall_s = time.perf_counter() - start
    return summarize(read_step_records(metrics), wall_s, first_record_s, last_record_s)


def summarize(steps: dict[int, dict], wall_s: float, first_record_s: float, last_record_s: float) -> dict:
    """A run's times from its step records: the first step's phases, start-up and compilations,
    the later steps' phase medians, and their steps' seconds and compilations in all; where the
    wall time goes beyond the first record and the steps: between the first and the last record
    outside the steps (logging, saves due mid-run), and after the last record (the final
    checkpoint, the process's exit)."""
    later = [record for step, record in steps.items() if step > 1]
    later_steps_s = sum(r["time/step_s"] for r in later)
    return {"wall_s": wall_s, "first_record_s": first_record_s, "last_record_s": last_record_s,
            "first_step": {phase: steps[1][phase] for phase in PHASES},
            "startup": {phase: steps[1][phase] for phase in STARTUP if phase in steps[1]},
            "compiles_first_step": {key: steps[1][key] for key in COMPILES if key in steps[1]},
            "compile_ahead": {key: steps[1][key] for key in COMPILE_AHEAD if key in steps[1]},
            "compiles_later_steps": {key: sum(r[key] for r in later if key in r) for key in COMPILES},
            "later_steps_s": later_steps_s,
            "between_records_beyond_steps_s": last_record_s - first_record_s - later_steps_s,
            "after_last_record_s": wall_s - last_record_s,
            "later_steps_median": {phase: statistics.median(r[phase] for r in later) for phase in PHASES}
            if later else None}


def compiling_seconds(run: dict) -> float:
    """A run's seconds in the phases where compiles fall (COMPILING_STARTUP, the first step)."""
    return sum(run["startup"].get(phase, 0.0) for phase in COMPILING_STARTUP) + run["first_step"]["time/step_s"]


def ratios(fresh: dict, warm: dict) -> dict:
    """Fresh against warm (whole run, first record), as ratios and as the seconds the empty caches
    add (a ratio grows when the run's fixed seconds shrink; the added seconds do not), the latter
    split into the phases where compiles fall and the rest (the runs' own spread), and each run's
    first step against its later ones."""
    compiling_s = compiling_seconds(fresh) - compiling_seconds(warm)
    out = {"wall_fresh_over_warm": fresh["wall_s"] / warm["wall_s"],
           "first_record_fresh_over_warm": fresh["first_record_s"] / warm["first_record_s"],
           "wall_fresh_minus_warm_s": fresh["wall_s"] - warm["wall_s"],
           "first_record_fresh_minus_warm_s": fresh["first_record_s"] - warm["first_record_s"],
           "compiling_fresh_minus_warm_s": compiling_s,
           "elsewhere_fresh_minus_warm_s": fresh["wall_s"] - warm["wall_s"] - compiling_s}
    for phase in fresh["startup"].keys() & warm["startup"].keys():
        warm_s = warm["startup"][phase]  # None where it took no time (default mode: no compile ahead)
        out[f"{phase.removeprefix('time/')}_fresh_over_warm"] = fresh["startup"][phase] / warm_s if warm_s else None
    for name, run in (("fresh", fresh), ("warm", warm)):
        if run["later_steps_median"]:
            for phase in PHASES:  # None where the later steps took no time (no optimizer step)
                later = run["later_steps_median"][phase]
                out[f"{name}_first_over_later_{phase.removeprefix('time/')}"] = (
                    run["first_step"][phase] / later if later else None)
    return out


def median_of_rounds(values: list[float | None]) -> float | None:
    """The rounds' median of a ratio, over the rounds that have it (a phase that took no time warm
    has none: default mode's compile ahead); None where none has."""
    present = [value for value in values if value is not None]
    return statistics.median(present) if present else None


def profile_growth(fresh: str, warm: str, top: int = 30) -> list[tuple[str, float, float]]:
    """The `top` functions whose cumulative seconds grew most from the warm run's cProfile file to
    the fresh run's: (function, fresh seconds, warm seconds), the most first. A function and its
    callers grow together; the deepest of a chain that grows by one amount is where it is spent."""
    def cumulative(path: str) -> dict[str, float]:
        return {f"{os.path.basename(file)}:{line}({name})": seconds
                for (file, line, name), (_, _, _, seconds, _) in pstats.Stats(path).stats.items()}
    fresh_s, warm_s = cumulative(fresh), cumulative(warm)
    rows = [(name, seconds, warm_s.get(name, 0.0)) for name, seconds in fresh_s.items()]
    return sorted(rows, key=lambda row: row[2] - row[1])[:top]


def print_profile_growth(growth: list[tuple[str, float, float]]) -> None:
    print(f"{'fresh s':>9} {'warm s':>9} {'grew s':>9}  function")
    for name, fresh_s, warm_s in growth:
        print(f"{fresh_s:9.2f} {warm_s:9.2f} {fresh_s - warm_s:9.2f}  {name}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", help="the JSON report")
    parser.add_argument("--rounds", type=positive_int, default=1)
    parser.add_argument("--profile", metavar="DIR",
                        help="run each run under cProfile, writing DIR/round<N>_fresh.prof and _warm.prof, and "
                             "print where the fresh run's extra seconds go (the profiler slows the runs: their "
                             "times are for finding, not for comparing with unprofiled ones)")
    parser.add_argument("flags", nargs=argparse.REMAINDER, help="after --: pretrain_rl.py's flags")
    args = parser.parse_args()
    flags = args.flags[1:] if args.flags[:1] == ["--"] else args.flags
    if not flags:
        parser.error("give pretrain_rl.py's flags after --")
    if args.profile:
        os.makedirs(args.profile, exist_ok=True)
    rounds = []
    for number in range(1, args.rounds + 1):
        profiles = {run: os.path.join(os.path.abspath(args.profile), f"round{number}_{run}.prof") if args.profile
                    else None for run in ("fresh", "warm")}
        with tempfile.TemporaryDirectory(prefix="first_step_") as root:
            cache_dir, work_dir = os.path.join(root, "caches"), os.path.join(root, "run")
            os.makedirs(work_dir)
            fresh = run_once(flags, cache_dir, work_dir, profiles["fresh"])
            kernels = {"fresh_triton_kernels": triton_kernels(cache_dir),
                       "fresh_flash_attention_kernels": flash_attention_kernels(cache_dir)}
            warm = run_once(flags, cache_dir, work_dir, profiles["warm"])
        rounds.append({"fresh": fresh, "warm": warm, "ratios": ratios(fresh, warm), **kernels})
        if args.profile:  # kept in the report too: what the docs cite of a profile is in a results file
            rounds[-1]["profile_growth"] = profile_growth(profiles["fresh"], profiles["warm"])
            print_profile_growth(rounds[-1]["profile_growth"])
    medians = {key: median_of_rounds([r["ratios"][key] for r in rounds]) for key in rounds[0]["ratios"]}
    report = {**provenance(), "flags": flags, "profiled": bool(args.profile), "rounds": rounds, "medians": medians}
    write_report(report, medians, args.output)


if __name__ == "__main__":
    main()
