"""bi/embedding.py on CPU: its backward is torch's embedding backward, run with torch's
deterministic-algorithms flag on and the flag put back after; the switch installs it and takes it
out (the GPU test, tests/gpu/test_embedding_backward.py, checks the bits it buys)."""

import pytest
import torch

from megatron_rl_bi import bi
from megatron_rl_bi.bi import embedding


def test_the_backward_is_torchs_with_the_flag_set_then_restored(monkeypatch):
    indices = torch.tensor([3, 1, 3, 0, 3])
    grad = torch.randn(5, 4)
    weight = torch.zeros(6, 4, requires_grad=True)
    torch.nn.functional.embedding(indices, weight).backward(grad)
    assert torch.equal(embedding.dense_backward(grad, indices, 6, -1, False), weight.grad)
    seen = []
    upstream = torch.ops.aten.embedding_dense_backward

    def recording(*args):
        seen.append((torch.are_deterministic_algorithms_enabled(), torch.utils.deterministic.fill_uninitialized_memory))
        return upstream(*args)

    monkeypatch.setattr(torch.ops.aten, "embedding_dense_backward", recording)
    embedding.dense_backward(grad, indices, 6, -1, False)
    assert seen == [(True, False)]
    assert not torch.are_deterministic_algorithms_enabled() and torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True)
    try:
        embedding.dense_backward(grad, indices, 6, -1, False)
        assert torch.are_deterministic_algorithms_enabled() and not torch.is_deterministic_algorithms_warn_only_enabled()
    finally:
        torch.use_deterministic_algorithms(False)


def test_the_switch_installs_it_and_takes_it_out(cpu_dispatch):
    assert not embedding.installed()
    with bi.batch_invariant():
        assert embedding.installed()
    assert not embedding.installed()


def test_a_failed_enable_takes_it_out(cpu_dispatch, monkeypatch):
    from megatron.core.transformer.custom_layers import batch_invariant_kernels

    monkeypatch.setattr(embedding, "install", lambda: (_ for _ in ()).throw(RuntimeError("no")))
    with pytest.raises(bi.BatchInvariantModeError):
        bi.enable()
    assert not embedding.installed() and not batch_invariant_kernels.is_batch_invariant_mode_enabled()


def test_autograd_reaches_it_through_the_ops_autograd_entry(monkeypatch):
    """Registered as the switch registers it (here for CPU tensors): F.embedding's backward runs
    it, with the flag set."""
    seen, upstream = [], torch.ops.aten.embedding_dense_backward
    library = torch.library.Library("aten", "IMPL")
    library.impl("embedding_dense_backward", embedding.dense_backward, "AutogradCPU")
    try:
        monkeypatch.setattr(torch.ops.aten, "embedding_dense_backward",
                            lambda *args: (seen.append(torch.are_deterministic_algorithms_enabled()), upstream(*args))[1])
        weight = torch.zeros(6, 4, requires_grad=True)
        torch.nn.functional.embedding(torch.tensor([3, 1, 3]), weight).backward(torch.ones(3, 4))
    finally:
        library._destroy()
    assert seen == [True] and weight.grad[3].tolist() == [2.0] * 4
