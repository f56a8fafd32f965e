"""Each phase's peak and the run's (reporting/gpu_memory.py), against a scripted allocator."""

import resource
import types

import torch

from megatron_rl_bi.reporting.gpu_memory import GIB, PeakMemory


class ScriptedAllocator:
    """torch.cuda's allocated and reserved bytes and their peak counters, which a reset sets to what
    is allocated and reserved; the GPU's free memory, of which `outside` is used beyond torch."""

    TOTAL = 80 * GIB

    def __init__(self):
        self.allocated = self.peak = self.reserved = self.reserved_peak = self.outside = 0

    def alloc(self, gib: int, reserve: int = 0) -> None:
        self.allocated += gib * GIB
        self.reserved = max(self.reserved, self.allocated + reserve * GIB)
        self.peak = max(self.peak, self.allocated)
        self.reserved_peak = max(self.reserved_peak, self.reserved)

    def free(self, gib: int, release: bool = False) -> None:
        self.allocated -= gib * GIB
        if release:  # torch.cuda.empty_cache()
            self.reserved = self.allocated

    def reset(self) -> None:
        self.peak, self.reserved_peak = self.allocated, self.reserved

    def mem_get_info(self) -> tuple[int, int]:
        return self.TOTAL - self.reserved - self.outside * GIB, self.TOTAL


def test_each_phase_has_its_own_peak_and_the_run_keeps_its_start(monkeypatch):
    memory = ScriptedAllocator()
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda: memory.peak)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda: memory.reserved_peak)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda: memory.reserved)
    monkeypatch.setattr(torch.cuda, "mem_get_info", memory.mem_get_info)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", memory.reset)
    monkeypatch.setattr(resource, "getrusage", lambda who: types.SimpleNamespace(ru_maxrss=5 * 2**20))  # KiB
    peak_memory = PeakMemory()
    memory.outside = 1  # the CUDA context
    memory.alloc(10, reserve=1)  # the start: model, optimizer, engine (11 reserved)
    memory.free(4, release=True)  # the engine's cache freed once built (6 reserved)
    first, second = {}, {}
    with peak_memory.phase("generation", first):
        memory.alloc(3)  # 9 reserved
        memory.free(3)
    memory.outside = 3  # NCCL, kernels' modules
    with peak_memory.phase("training", first):
        memory.alloc(2)
        memory.free(2)
    assert first == {"memory/peak_generation_gib": 9, "memory/peak_training_gib": 8, "memory/peak_allocated_gib": 10,
                     "memory/peak_reserved_gib": 11, "memory/beyond_torch_gib": 3, "memory/peak_host_gib": 5}
    memory.outside = 2  # beyond torch keeps its most
    with peak_memory.phase("generation", second):
        memory.alloc(7, reserve=1)  # 14 reserved
        memory.free(7, release=True)
    assert second == {"memory/peak_generation_gib": 13, "memory/peak_allocated_gib": 13, "memory/peak_reserved_gib": 14,
                      "memory/beyond_torch_gib": 3, "memory/peak_host_gib": 5}
