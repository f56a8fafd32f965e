"""megatron's profiling flags in the RL loop. Steps [--profile-step-start, --profile-step-end) of
the ranks in --profile-ranks (every rank when empty) are traced, generation and training both:
- `--profile`: the CUDA profiler API marks the steps, for `nsys profile
  --capture-range=cudaProfilerApi --capture-range-end=stop`;
- `--profile --use-pytorch-profiler`: torch.profiler records them; each rank writes its trace
  (Perfetto or chrome://tracing) and a table of the ops that took the most GPU time into
  --tensorboard-dir.
`--record-memory-history` (megatron's, with --memory-snapshot-path and --profile-ranks) records
the caching allocator's events from before the model is built; after each RL step a recording
trainer rank writes the newest of them (the step's generation and training) as a snapshot for
pytorch.org/memory_viz, and megatron's out-of-memory observer writes one where an allocation
fails (a generator rank's only snapshot, --rl-generator-ranks)."""

import contextlib
import os
from dataclasses import dataclass

import torch
from megatron.training.config import ProfilingConfig
from megatron.training.utils.utils import start_memory_history_recording


@dataclass(frozen=True)
class ProfileConfig:
    start: int
    """The first profiled step (--profile-step-start)."""
    end: int
    """The step after the last profiled one (--profile-step-end)."""
    ranks: tuple[int, ...] = ()
    """The profiled ranks (--profile-ranks); empty: every rank."""
    output_dir: str | None = None
    """torch.profiler's trace and table go here (--tensorboard-dir); None: nsys."""
    shapes: bool = False
    """Input shapes of each op (--pytorch-profiler-collect-shapes)."""
    stack: bool = False
    """Python call stacks (--pytorch-profiler-collect-callstack)."""


def _asked_for(ranks: tuple[int, ...], rank: int) -> bool:
    """Whether --profile-ranks takes `rank` (empty: every rank)."""
    return not ranks or rank in ranks


@dataclass(frozen=True)
class MemoryHistoryConfig:
    path: str
    """The snapshot file (--memory-snapshot-path); a rank of several writes PATH_rank-R.EXT."""
    ranks: tuple[int, ...] = ()
    """The recording ranks (--profile-ranks); empty: every rank."""


def start_memory_history(config: MemoryHistoryConfig | None) -> None:
    """Megatron's recording of the allocator's events (up to 100,000, with their Python stacks),
    started before the model is built so its weights are in the history."""
    if config is None:
        return
    start_memory_history_recording(ProfilingConfig(record_memory_history=True, memory_snapshot_path=config.path,
                                                   profile_ranks=list(config.ranks)))


class MemorySnapshots:
    def __init__(self, config: MemoryHistoryConfig | None):
        rank, world_size = torch.distributed.get_rank(), torch.distributed.get_world_size()
        self.path = None
        if config and _asked_for(config.ranks, rank):
            base, ext = os.path.splitext(config.path)
            self.path = config.path if world_size == 1 else f"{base}_rank-{rank}{ext}"
            os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)

    def after_step(self) -> None:
        """The newest events, in place of the last step's (written whole, then renamed: a run
        stopped while writing leaves the previous snapshot)."""
        if self.path is None:
            return
        torch.cuda.memory._dump_snapshot(self.path + ".tmp")
        os.replace(self.path + ".tmp", self.path)


class StepProfiler:
    def __init__(self, config: ProfileConfig | None, rank: int, snapshots: MemorySnapshots | None = None):
        self.config = config if config and _asked_for(config.ranks, rank) else None
        self.rank = rank
        self.recording = None  # torch.profiler.profile while it records, True for nsys
        self.snapshots = snapshots

    @contextlib.contextmanager
    def step(self, step: int):
        """One RL step, profiled when it is in the configured range."""
        if self.config and step == self.config.start:
            self._start()
        yield
        if self.snapshots:
            self.snapshots.after_step()
        if self.config and step == self.config.end - 1:
            self.finish()

    def _start(self) -> None:
        if self.config.output_dir is None:
            torch.cuda.cudart().cudaProfilerStart()
            self.recording = True
            return
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.recording = torch.profiler.profile(activities=activities, record_shapes=self.config.shapes,
                                                with_stack=self.config.stack)
        self.recording.start()

    def finish(self) -> None:
        """Ends the profile, if one is recording (also when the run stops inside the range)."""
        if self.recording is None:
            return
        recording, self.recording = self.recording, None
        if recording is True:
            torch.cuda.cudart().cudaProfilerStop()
            return
        recording.stop()
        os.makedirs(self.config.output_dir, exist_ok=True)
        name = os.path.join(self.config.output_dir, f"profile_rank{self.rank}_steps{self.config.start}-"
                                                    f"{self.config.end - 1}")
        recording.export_chrome_trace(name + ".json.gz")
        sort_by = "device_time_total" if torch.cuda.is_available() else "cpu_time_total"
        with open(name + ".txt", "w") as table:
            table.write(recording.key_averages().table(sort_by=sort_by, row_limit=40) + "\n")
        print(f"profile of steps {self.config.start}-{self.config.end - 1}: {name}.json.gz, {name}.txt",
              flush=True)
