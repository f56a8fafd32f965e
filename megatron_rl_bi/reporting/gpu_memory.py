"""The GPU memory each phase of an RL step reached, for the step records, beside the memory
plan's prediction of the same phases (megatron_rl_bi/memory.py)."""

import contextlib

import torch

GIB = 2**30


class PeakMemory:
    """torch's one peak counter, split by phase: each phase's own peak, and the run's so far (its
    start included, where the model, the optimizer and the engine are placed)."""

    def __init__(self):
        self.run_peak = 0

    @contextlib.contextmanager
    def phase(self, name: str, peaks: dict):
        """Writes `memory/peak_<name>_gib` (this phase) and `memory/peak_allocated_gib` (the run
        so far) into `peaks`."""
        self._take()
        yield
        peaks[f"memory/peak_{name}_gib"] = self._take() / GIB
        peaks["memory/peak_allocated_gib"] = self.run_peak / GIB

    def _take(self) -> int:
        """The peak since the last call (bytes); the counter starts again from what is allocated."""
        peak = torch.cuda.max_memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        self.run_peak = max(self.run_peak, peak)
        return peak
