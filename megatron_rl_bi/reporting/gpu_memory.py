"""The GPU memory each phase of an RL step reached, for the step records, beside the memory
plan's prediction of the same phases (megatron_rl_bi/memory.py); and the process's host peak,
beside the plan's host line."""

import contextlib
import resource

import torch

GIB = 2**30


class PeakMemory:
    """torch's one peak counter, split by phase: each phase's own peak, and the run's so far (its
    start included, where the model, the optimizer and the engine are placed)."""

    def __init__(self):
        self.run_peak = 0

    @contextlib.contextmanager
    def phase(self, name: str, peaks: dict):
        """Writes `memory/peak_<name>_gib` (this phase), `memory/peak_allocated_gib` (the run
        so far) and `memory/peak_host_gib` (the process's largest resident set so far, pinned
        buffers included) into `peaks`."""
        self._take()
        yield
        peaks[f"memory/peak_{name}_gib"] = self._take() / GIB
        peaks["memory/peak_allocated_gib"] = self.run_peak / GIB
        peaks["memory/peak_host_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB  # KiB on Linux

    def _take(self) -> int:
        """The peak since the last call (bytes); the counter starts again from what is allocated."""
        peak = torch.cuda.max_memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        self.run_peak = max(self.run_peak, peak)
        return peak
