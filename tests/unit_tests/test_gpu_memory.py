"""Each phase's peak and the run's (reporting/gpu_memory.py), against a scripted allocator."""

import resource
import types

import torch

from megatron_rl_bi.reporting.gpu_memory import GIB, PeakMemory


class ScriptedAllocator:
    """torch.cuda's allocated bytes and its one peak counter, which a reset sets to what is allocated."""

    def __init__(self):
        self.allocated = self.peak = 0

    def alloc(self, gib: int) -> None:
        self.allocated += gib * GIB
        self.peak = max(self.peak, self.allocated)

    def free(self, gib: int) -> None:
        self.allocated -= gib * GIB

    def reset(self) -> None:
        self.peak = self.allocated


def test_each_phase_has_its_own_peak_and_the_run_keeps_its_start(monkeypatch):
    memory = ScriptedAllocator()
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda: memory.peak)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", memory.reset)
    monkeypatch.setattr(resource, "getrusage", lambda who: types.SimpleNamespace(ru_maxrss=5 * 2**20))  # KiB
    peak_memory = PeakMemory()
    memory.alloc(10)  # the start: model, optimizer, engine
    memory.free(4)  # the engine's cache freed once built
    first, second = {}, {}
    with peak_memory.phase("generation", first):
        memory.alloc(3)
        memory.free(3)
    with peak_memory.phase("training", first):
        memory.alloc(2)
        memory.free(2)
    assert first == {"memory/peak_generation_gib": 9, "memory/peak_training_gib": 8, "memory/peak_allocated_gib": 10,
                     "memory/peak_host_gib": 5}
    with peak_memory.phase("generation", second):
        memory.alloc(7)
        memory.free(7)
    assert second == {"memory/peak_generation_gib": 13, "memory/peak_allocated_gib": 13, "memory/peak_host_gib": 5}
