"""The optimizer's GPU state waits in page-locked host memory while the engine generates
(--rl-offload-optimizer-during-inference). The tensors are those megatron-core's
`MegatronOptimizer.offload_to_cpu` moves: each inner optimizer's parameters (the fp32 main
weights) and state (Adam's moments). That one copies each tensor into freshly allocated pageable
memory, one synchronous copy after another, every generation; here each tensor has a page-locked
host buffer kept for the run, and the copies run asynchronously with one wait. The state is
moved, not recomputed: it comes back bit for bit."""

import contextlib
import weakref

import torch

# One set of buffers per optimizer, for the run: the engine's build and every generation reuse them.
_PARKINGS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def optimizer_tensor_slots(optimizer) -> list[tuple[object, str | None]]:
    """(holder, key) of every tensor the offload moves: a parameter (key None: its .data) or an
    entry of a parameter's state, in each inner optimizer (megatron-core's ChainedOptimizer holds
    several; a stub optimizer has none). A view of another tensor is not moved: with the main
    weights on the CPU (--optimizer-cpu-offload) megatron-core's distributed optimizer gives its
    inner optimizer shards of DDP's bf16 parameter buffer, which the model's weights are views of
    too. Moving such a shard frees nothing (the buffer stays), and bringing it back as a tensor of
    its own would cut it off from the weights: the optimizer's updates would land in a copy."""
    slots = []
    for inner in getattr(optimizer, "chained_optimizers", None) or [optimizer]:
        torch_optimizer = getattr(inner, "optimizer", None)
        if torch_optimizer is None or getattr(inner, "is_stub_optimizer", False):
            continue
        slots += [(param, None) for group in torch_optimizer.param_groups for param in group["params"]
                  if param._base is None]
        slots += [(state, key) for state in torch_optimizer.state.values()
                  for key, value in state.items() if isinstance(value, torch.Tensor) and value._base is None]
    return slots


def optimizer_tensors(optimizer) -> list[torch.Tensor]:
    """The tensors of `optimizer_tensor_slots`, where they are now."""
    return [_get(holder, key) for holder, key in optimizer_tensor_slots(optimizer)]


def _get(holder, key) -> torch.Tensor:
    return holder.data if key is None else holder[key]


def _put(holder, key, tensor: torch.Tensor) -> None:
    if key is None:
        holder.data = tensor
    else:
        holder[key] = tensor


def _page_locked_like(tensor: torch.Tensor) -> torch.Tensor:
    """A host tensor of `tensor`'s shape and dtype, page-locked where it lies (cudaHostRegister,
    undone when the tensor goes), so that copies to and from it are asynchronous DMA. torch's
    pinned allocator would round each buffer up to a power of two: up to twice the host memory
    (an embedding's state of 4.1 GB would take 8)."""
    host = torch.empty(tensor.shape, dtype=tensor.dtype)
    if host.numel():
        cudart = torch.cuda.cudart()
        torch.cuda.check_error(cudart.cudaHostRegister(host.data_ptr(), host.numel() * host.element_size(), 0))
        weakref.finalize(host, cudart.cudaHostUnregister, host.data_ptr())
    return host


class _Parking:
    def __init__(self):
        self.buffers = {}  # (id(holder), key) -> page-locked host tensor
        self.parked = []  # the slots now on the host, to bring back

    def park(self, optimizer) -> None:
        moved = []
        for holder, key in optimizer_tensor_slots(optimizer):
            tensor = _get(holder, key)
            if not tensor.is_cuda:  # e.g. --optimizer-cpu-offload's state: it stays where it is
                continue
            buffer = self.buffers.get((id(holder), key))
            if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
                buffer = self.buffers[id(holder), key] = _page_locked_like(tensor)
            buffer.copy_(tensor, non_blocking=True)
            moved.append((holder, key, buffer))
        torch.cuda.synchronize()  # every copy has landed before the GPU memory is let go
        for holder, key, buffer in moved:
            _put(holder, key, buffer)
        self.parked = [(holder, key) for holder, key, _ in moved]
        torch.cuda.empty_cache()  # the engine's cache is one allocation: it needs whole segments

    def unpark(self) -> None:
        device = torch.cuda.current_device()
        for holder, key in self.parked:  # stream-ordered: the trainer's kernels come after the copies
            _put(holder, key, _get(holder, key).to(device, non_blocking=True))
        self.parked = []


@contextlib.contextmanager
def generating(optimizer, offload_optimizer: bool):
    """The engine's phase (its build and each generation): with `offload_optimizer`
    (--rl-offload-optimizer-during-inference) the optimizer's GPU state waits in page-locked host
    memory for its duration."""
    if not offload_optimizer:
        yield
        return
    parking = _PARKINGS.setdefault(optimizer, _Parking())
    parking.park(optimizer)
    try:
        yield
    finally:
        parking.unpark()
