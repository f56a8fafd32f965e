"""megatron's profiling flags in the RL loop (reporting/profiling.py), on CPU: which steps are
traced, by which profiler, on which ranks, into which files; the allocator's history, recorded by
megatron's function on the ranks asked for and written after each step; and the flags that would
trace nothing."""

import gzip
import json

import pytest
import torch

from megatron_rl_bi.config import parse_rl_args, rl_args
from megatron_rl_bi.config.from_args import loop_config_from_args
from megatron_rl_bi.reporting import profiling
from megatron_rl_bi.reporting.profiling import (MemoryHistoryConfig, MemorySnapshots, ProfileConfig, StepProfiler,
                                                start_memory_history)

MODEL = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "64",
         "--max-position-embeddings", "64", "--micro-batch-size", "1", "--rl-task", "sort", "--rl-tokenizer", "char",
         "--train-iters", "5"]


STEP_OPS = {1: torch.add, 2: torch.mm, 3: torch.sub, 4: torch.mul, 5: torch.div}


def _run(profiler: StepProfiler, steps: range) -> None:
    """Each step runs an op of its own, which tells the profile which steps it saw."""
    a = torch.ones(4, 4)
    for step in steps:
        with profiler.step(step):
            STEP_OPS[step](a, a)


def _traced(table: str) -> list[int]:
    return [step for step, op in STEP_OPS.items() if f"aten::{op.__name__} " in table]


def test_the_pytorch_profiler_traces_the_steps_asked_for(tmp_path):
    profiler = StepProfiler(ProfileConfig(start=2, end=4, output_dir=str(tmp_path)), rank=0)
    _run(profiler, range(1, 6))
    assert _traced((tmp_path / "profile_rank0_steps2-3.txt").read_text()) == [2, 3]
    with gzip.open(tmp_path / "profile_rank0_steps2-3.json.gz") as trace:
        names = {event.get("name") for event in json.load(trace)["traceEvents"]}
    assert [step for step, op in STEP_OPS.items() if f"aten::{op.__name__}" in names] == [2, 3]


def test_a_run_that_stops_inside_the_range_still_writes_its_profile(tmp_path):
    profiler = StepProfiler(ProfileConfig(start=2, end=9, output_dir=str(tmp_path)), rank=3)
    _run(profiler, range(1, 4))
    profiler.finish()
    assert _traced((tmp_path / "profile_rank3_steps2-8.txt").read_text()) == [2, 3]


class _CudaProfilerApi:
    def __init__(self, log: list):
        self.log = log

    def cudaProfilerStart(self):
        self.log.append("start")

    def cudaProfilerStop(self):
        self.log.append("stop")


@pytest.mark.parametrize("ranks, rank, marked", [((), 0, True), ((0, 2), 2, True), ((1,), 0, False)])
def test_nsys_gets_the_steps_of_the_ranks_asked_for(monkeypatch, ranks, rank, marked):
    log = []
    monkeypatch.setattr(torch.cuda, "cudart", lambda: _CudaProfilerApi(log))
    profiler = StepProfiler(ProfileConfig(start=2, end=4, ranks=ranks), rank=rank)
    for step in range(1, 6):
        with profiler.step(step):
            log.append(step)
    assert log == ([1, "start", 2, 3, "stop", 4, 5] if marked else [1, 2, 3, 4, 5])


def test_the_flags_make_the_config(monkeypatch):
    monkeypatch.setattr(rl_args, "logger_package_errors", lambda args: [])  # tensorboard need not be here
    args = parse_rl_args(MODEL + ["--profile", "--use-pytorch-profiler", "--profile-step-start", "2",
                                  "--profile-step-end", "3", "--profile-ranks", "0", "1",
                                  "--tensorboard-dir", "tb", "--pytorch-profiler-collect-shapes"])
    assert loop_config_from_args(args).profile == ProfileConfig(start=2, end=3, ranks=(0, 1), output_dir="tb",
                                                                shapes=True)
    nsys = parse_rl_args(MODEL + ["--profile", "--profile-step-start", "1", "--profile-step-end", "2"])
    assert loop_config_from_args(nsys).profile == ProfileConfig(start=1, end=2)
    assert loop_config_from_args(parse_rl_args(MODEL)).profile is None


@pytest.mark.parametrize("flags, message", [
    (["--use-pytorch-profiler"], "--use-pytorch-profiler needs --profile"),
    (["--profile", "--profile-step-start", "3", "--profile-step-end", "3"], r"the steps traced are \[start, end\)"),
    (["--profile", "--profile-step-start", "0", "--profile-step-end", "2"], r"1 <= start < end"),
    (["--profile", "--profile-step-start", "6", "--profile-step-end", "8"],
     r"--profile-step-start 6 is after the last step \(--train-iters 5\)"),
    (["--profile", "--profile-step-start", "1", "--profile-step-end", "2", "--use-pytorch-profiler"],
     "--use-pytorch-profiler writes each rank's trace and op table to --tensorboard-dir"),
    (["--rl-profile"], "--rl-profile: not used by pretrain_rl.py"),
    (["--memory-snapshot-path", "m.pickle"], "--memory-snapshot-path: a snapshot is written only with "
                                             "--record-memory-history"),
])
def test_profiles_that_would_trace_nothing_are_refused(flags, message):
    with pytest.raises(ValueError, match=message):
        parse_rl_args(MODEL + flags)


def test_the_memory_history_flags_make_the_config():
    args = parse_rl_args(MODEL + ["--record-memory-history", "--memory-snapshot-path", "m/s.pickle",
                                  "--profile-ranks", "1"])
    assert loop_config_from_args(args).memory_history == MemoryHistoryConfig(path="m/s.pickle", ranks=(1,))
    default = loop_config_from_args(parse_rl_args(MODEL + ["--record-memory-history"])).memory_history
    assert default == MemoryHistoryConfig(path="snapshot.pickle")  # megatron's default path
    assert loop_config_from_args(parse_rl_args(MODEL)).memory_history is None


def test_megatrons_function_records_on_the_ranks_asked_for(monkeypatch):
    started = []
    monkeypatch.setattr(profiling, "start_memory_history_recording", started.append)
    start_memory_history(None)
    assert started == []
    start_memory_history(MemoryHistoryConfig(path="s.pickle", ranks=(0, 3)))
    (config,) = started
    assert (config.record_memory_history, config.memory_snapshot_path, config.profile_ranks) == (True, "s.pickle",
                                                                                                [0, 3])


def _dumps(monkeypatch, fail: bool = False) -> list[str]:
    """The snapshots torch is asked for, each written as a file holding its own name."""
    written = []

    def dump(filename):
        with open(filename, "w") as f:
            f.write("partial" if fail else filename)
        if fail:
            raise RuntimeError("stopped while writing")
        written.append(filename)
    monkeypatch.setattr(torch.cuda.memory, "_dump_snapshot", dump)
    return written


@pytest.mark.parametrize("ranks, rank, world, name", [((), 0, 1, "s.pickle"), ((), 2, 4, "s_rank-2.pickle"),
                                                      ((1, 2), 1, 4, "s_rank-1.pickle"), ((1,), 0, 4, None)])
def test_a_recording_rank_writes_its_snapshot_after_each_step(monkeypatch, tmp_path, ranks, rank, world, name):
    written = _dumps(monkeypatch)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda: rank)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda: world)
    profiler = StepProfiler(None, rank, MemorySnapshots(MemoryHistoryConfig(path=str(tmp_path / "s.pickle"),
                                                                            ranks=ranks)))
    for step in (1, 2):
        with profiler.step(step):
            pass
    assert sorted(p.name for p in tmp_path.iterdir()) == ([name] if name else [])
    assert len(written) == (2 if name else 0)
    if name:
        assert (tmp_path / name).read_text() == str(tmp_path / name) + ".tmp"  # written whole, then renamed


def test_a_snapshot_stopped_while_written_leaves_the_last_one(monkeypatch, tmp_path, gloo_group):
    path = tmp_path / "s.pickle"
    _dumps(monkeypatch)
    snapshots = MemorySnapshots(MemoryHistoryConfig(path=str(path)))
    snapshots.after_step()
    _dumps(monkeypatch, fail=True)
    with pytest.raises(RuntimeError, match="stopped while writing"):
        snapshots.after_step()
    assert path.read_text() == str(path) + ".tmp"
    assert MemorySnapshots(None).path is None
