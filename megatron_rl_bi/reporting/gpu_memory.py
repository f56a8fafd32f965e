"""The GPU memory each phase of an RL step reached, for the step records, beside the memory
plan's prediction of the same phases (megatron_rl_bi/memory.py); what the GPU holds beyond torch's
allocator; and the process's host peak, beside the plan's host line."""

import contextlib
import resource

import torch

GIB = 2**30


class PeakMemory:
    """torch's peak counters, split by phase: each phase's own peak, and the run's so far (its
    start included, where the model, the optimizer and the engine are placed)."""

    def __init__(self):
        self.run_peak = self.run_reserved_peak = self.beyond_torch = 0

    @contextlib.contextmanager
    def phase(self, name: str, peaks: dict):
        """Writes into `peaks`: `memory/peak_<name>_gib` (this phase's allocated peak),
        `memory/peak_allocated_gib` and `memory/peak_reserved_gib` (the run's so far: tensors, and
        the allocator's segments), `memory/beyond_torch_gib` (beyond_torch) and
        `memory/peak_host_gib` (the process's largest resident set so far, pinned buffers included)."""
        self._take()
        yield
        peaks[f"memory/peak_{name}_gib"] = self._take() / GIB
        peaks["memory/peak_allocated_gib"] = self.run_peak / GIB
        peaks["memory/peak_reserved_gib"] = self.run_reserved_peak / GIB
        peaks["memory/beyond_torch_gib"] = self._beyond_torch() / GIB
        peaks["memory/peak_host_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB  # KiB on Linux

    def _take(self) -> int:
        """The allocated peak since the last call (bytes); the counters start again from what is
        allocated and reserved."""
        peak = torch.cuda.max_memory_allocated()
        self.run_reserved_peak = max(self.run_reserved_peak, torch.cuda.max_memory_reserved())
        torch.cuda.reset_peak_memory_stats()
        self.run_peak = max(self.run_peak, peak)
        return peak

    def _beyond_torch(self) -> int:
        """The most, at a phase's end so far, of the GPU's used memory less torch's reservation in
        this process: on a GPU of its own, the CUDA context, NCCL, cuBLAS and the kernels'
        modules, which the memory plan's peak leaves out (an H100 run the plan said fitted with
        2.1 GiB to spare failed with 1.9 GiB of it so used); with other processes on the GPU,
        theirs too."""
        free, total = torch.cuda.mem_get_info()
        self.beyond_torch = max(self.beyond_torch, total - free - torch.cuda.memory_reserved())
        return self.beyond_torch
