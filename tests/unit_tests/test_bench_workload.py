"""bench/workload.py's report of what keeps memory alive between the bench's two modes (CPU:
the same search over CPU tensors)."""

import torch

from bench.workload import largest_live_tensors


class ExpertWeights:
    """Holds its tensor in a dict, as a module holds its parameters."""

    def __init__(self, weight: torch.Tensor):
        self.tensors = {"weight": weight}


def test_the_largest_live_storages_are_named_with_their_holders():
    storage = torch.UntypedStorage(24 << 20)  # 24 MiB
    part = ExpertWeights(torch.empty(0, dtype=torch.uint8).set_(storage, 0, (1 << 20,)))  # made first
    whole = ExpertWeights(torch.empty(0, dtype=torch.uint8).set_(storage, 0, (24 << 20,)))
    listed = largest_live_tensors("cpu", 50)
    ours = [row for row in listed if "ExpertWeights" in row["held_by"]]
    assert ours == [{"gib": 24 / 1024, "shape": [24 << 20], "dtype": "torch.uint8", "held_by": ["ExpertWeights"]}]
    assert part.tensors["weight"].untyped_storage().data_ptr() == whole.tensors["weight"].untyped_storage().data_ptr()


class Parameter:
    """Holds a view of a buffer as an attribute, as megatron-core's parameters hold `main_grad`."""

    def __init__(self, main_grad: torch.Tensor):
        self.main_grad = main_grad


def test_a_buffer_only_its_views_hold_is_named_by_the_views_holders():
    """megatron-core's gradient buffer: no Python object holds the buffer's own tensor, each
    parameter a view of it (an H100's bench named its 11.6 GiB buffer held by nobody)."""
    buffer = torch.empty(20 << 20, dtype=torch.uint8)
    parameters = [Parameter(buffer[i << 20:(i + 1) << 20]) for i in range(2)]
    del buffer
    ours = [row for row in largest_live_tensors("cpu", 50) if row["gib"] == 20 / 1024]
    assert ours == [{"gib": 20 / 1024, "shape": [20 << 20], "dtype": "torch.uint8", "held_by": ["Parameter"]}]
    assert len(parameters) == 2
