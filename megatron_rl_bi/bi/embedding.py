"""The embedding's weight gradient, repeatable bit for bit in BI mode.

torch 2.11's CUDA embedding backward (`embedding_dense_backward`, the H200's torch), for more than
3,072 indices over few distinct rows (a small vocabulary: the tiny recipes' character tokenizer), takes a fused
kernel that adds partial sums into the gradient with atomics, in whatever order the GPU runs
them; torch skips it when its deterministic-algorithms flag is set, for its two-pass kernel.
megatron-core's embedding calls `F.embedding` (its deterministic mode's indexing instead changes
the bits of every case, and more than the embedding). So while the switch is on, the op's
autograd entry runs it with that flag set, and only it: the cases that already took a
deterministic kernel (the feature kernel up to 3,072 indices, the two-pass one otherwise) keep
their kernel and their bits. Seen on the H200: the tiny search recipe's warm-up (about 6,200
indices a step, 128 rows) gave another embedding gradient once in about 120 backward passes, and
runs of the recipe parted there.
"""

import contextlib

import torch

_library: torch.library.Library | None = None  # the override, while the switch is on


@contextlib.contextmanager
def deterministic_algorithms():
    """torch's deterministic-algorithms flag on for the block (without filling new memory, which
    only costs time), then as it was."""
    was_on, warn_only = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    fill = torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = False
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(was_on, warn_only=warn_only)
        torch.utils.deterministic.fill_uninitialized_memory = fill


def dense_backward(grad: torch.Tensor, indices: torch.Tensor, num_weights: int, padding_idx: int,
                   scale_grad_by_freq: bool) -> torch.Tensor:
    """`aten::embedding_dense_backward` below autograd, with the flag set (no double backward)."""
    with deterministic_algorithms(), torch._C._AutoDispatchBelowAutograd():
        return torch.ops.aten.embedding_dense_backward(grad, indices, num_weights, padding_idx, scale_grad_by_freq)


def install() -> None:
    global _library
    if _library is None:
        _library = torch.library.Library("aten", "IMPL")
        _library.impl("embedding_dense_backward", dense_backward, "AutogradCUDA")


def uninstall() -> None:
    global _library
    if _library is not None:
        _library._destroy()
        _library = None


def installed() -> bool:
    return _library is not None
