"""The BI switch is atomic and complete without TransformerEngine (CPU: only dispatch is checked,
the Triton kernels themselves run on the GPU)."""

import pytest
import torch
from megatron.core.transformer.custom_layers import batch_invariant_kernels as mcore_bik

from megatron_rl_bi import bi, compat
from megatron_rl_bi.bi import gemm, log_softmax, mean, rmsnorm


@pytest.fixture
def mm_calls(monkeypatch, cpu_dispatch):
    """Records calls that reach megatron-core's BI mm override (stands in for the GPU kernel)."""
    calls = []

    def recording_mm(a, b):
        calls.append(a.shape)
        return torch.zeros(a.shape[0], b.shape[1], dtype=a.dtype)

    monkeypatch.setattr(mcore_bik, "mm_batch_invariant", recording_mm)
    yield calls
    bi.disable()


def test_enable_routes_mm_and_disable_restores(mm_calls):
    a, b = torch.randn(3, 4), torch.randn(4, 5)
    bi.enable()
    assert bi.enabled()
    assert torch.equal(torch.mm(a, b), torch.zeros(3, 5))
    assert mm_calls == [torch.Size([3, 4])]
    bi.disable()
    assert not bi.enabled()
    assert torch.allclose(torch.mm(a, b), a @ b.clone())
    assert len(mm_calls) == 1


def test_our_kernels_stand_in_for_megatron_cores_while_on(mm_calls):
    upstream_norm = mcore_bik.BatchInvariantRMSNormFn
    bi.enable()
    assert mcore_bik.matmul_persistent is gemm.matmul
    assert mcore_bik.BatchInvariantRMSNormFn is rmsnorm.BatchInvariantRMSNorm
    assert mcore_bik.log_softmax is log_softmax.log_softmax
    bi.disable()
    assert mcore_bik.matmul_persistent is gemm.MCORE_MATMUL
    assert mcore_bik.BatchInvariantRMSNormFn is upstream_norm
    assert mcore_bik.log_softmax is log_softmax.MCORE_LOG_SOFTMAX


def test_enable_is_idempotent(mm_calls):
    bi.enable()
    bi.enable()
    bi.disable()
    assert not bi.enabled()
    torch.mm(torch.randn(2, 2), torch.randn(2, 2))
    assert mm_calls == []


def test_failed_enable_rolls_everything_back(mm_calls, monkeypatch):
    def broken_te_patch():
        raise ImportError("transformer_engine is broken")

    monkeypatch.setattr(compat, "transformer_engine_installed", lambda: True)
    monkeypatch.setattr(mcore_bik, "_te_patch_for_batch_invariant", broken_te_patch)
    with pytest.raises(bi.BatchInvariantModeError, match="rolled back"):
        bi.enable()
    assert not bi.enabled() and mcore_bik.matmul_persistent is gemm.MCORE_MATMUL
    torch.mm(torch.randn(2, 2), torch.randn(2, 2))
    assert mm_calls == []


def test_context_manager_restores_previous_state(mm_calls):
    with bi.batch_invariant(True):
        assert bi.enabled()
        with bi.batch_invariant(False):
            assert not bi.enabled()
        assert bi.enabled()
    assert not bi.enabled()


@pytest.mark.skipif(compat.transformer_engine_installed(), reason="pins the no-TE upstream bug")
def test_upstream_enable_without_te_half_enables(mm_calls):
    """Why compat.transformer_engine_optional exists. When this fails, upstream fixed it."""
    with pytest.raises(ModuleNotFoundError):
        mcore_bik.enable_batch_invariant_mode()
    assert mcore_bik.is_batch_invariant_mode_enabled()  # half-enabled
    torch.mm(torch.randn(2, 2), torch.randn(2, 2))
    assert len(mm_calls) == 1  # the aten override stayed registered


def test_upstream_full_mean_returns_the_sum(cpu_dispatch):
    """Why bi.mean exists. When this fails, upstream fixed it."""
    x = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    with compat.transformer_engine_optional():
        mcore_bik.enable_batch_invariant_mode()
    try:
        assert x.mean().item() == 10.0
    finally:
        mcore_bik.disable_batch_invariant_mode()


def test_full_mean_divides_by_the_element_count_while_on(cpu_dispatch, monkeypatch):
    x = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    listed = []

    def recording_mean(input, dim, keepdim=False, dtype=None):
        listed.append(dim)
        return input[0]

    monkeypatch.setattr(mean, "_upstream_mean", recording_mean)
    with bi.batch_invariant(True):
        assert mcore_bik.mean_batch_invariant is mean.mean
        assert x.mean().item() == 2.5
        assert torch.mean(x, dim=None).item() == 2.5
        assert x.mean(dim=[], keepdim=True).shape == (1, 1)
        assert x.bfloat16().mean().dtype == torch.bfloat16
        assert x.mean(dtype=torch.float64).dtype == torch.float64
        x.mean(dim=(0, 1))  # listed dims: megatron-core's kernel, unchanged
    assert listed == [[0, 1]]
    assert mcore_bik.mean_batch_invariant is not mean.mean


def test_full_mean_of_integers_needs_a_float_dtype():
    ints = torch.tensor([1, 2, 4])
    with pytest.raises(TypeError, match="floating-point dtype"):
        mean.mean(ints, [])
    assert torch.equal(mean.mean(ints, [], dtype=torch.float32), torch.tensor(7.0) / 3)
