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
