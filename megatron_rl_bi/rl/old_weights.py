"""Earlier weight versions kept on the CPU (--rl-keep-old-weights N), so that rollouts generated
ahead (--rl-generation-lag) can be recomputed under the weights that sampled them: in BI mode
that comparison is exactly 0, the proof that staleness explains every other difference."""

import contextlib
from collections import OrderedDict

import torch


class KeptWeights:
    """The newest `count` weight versions of a module, by version (optimizer steps taken)."""

    def __init__(self, count: int):
        self.count, self.versions = count, OrderedDict()

    def keep(self, version: int, module: torch.nn.Module) -> None:
        """A CPU copy of `module`'s parameters and buffers as they are at `version`."""
        if not self.count or version in self.versions:
            return
        self.versions[version] = {name: t.detach().to("cpu", copy=True) for name, t in weight_tensors(module)}
        while len(self.versions) > self.count:
            self.versions.popitem(last=False)

    @contextlib.contextmanager
    def swapped_in(self, module: torch.nn.Module, version: int):
        """`module` with the weights of `version` for the block, its own weights back after,
        bit for bit (the optimizer's fp32 copies are not touched)."""
        current = {name: t.detach().to("cpu", copy=True) for name, t in weight_tensors(module)}
        _copy_into(module, self.versions[version])
        try:
            yield
        finally:
            _copy_into(module, current)


def weight_tensors(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """A module's weights by name: its parameters, then its buffers."""
    return [*module.named_parameters(), *module.named_buffers()]


@torch.no_grad()
def _copy_into(module: torch.nn.Module, values: dict[str, torch.Tensor]) -> None:
    for name, tensor in weight_tensors(module):
        tensor.copy_(values[name])
