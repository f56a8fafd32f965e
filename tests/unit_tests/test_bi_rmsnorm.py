"""bi.rmsnorm's kernels on CPU (Triton interpreter, fp32 in and out): forward and both gradients
against the fp64 formula, zero-centred gamma, rows independent of the batch, and any leading
shape. Tolerances are fp32 rounding (the formula runs in fp64); the bitwise claim on the GPU is
tests/gpu/test_bi_kernels.py."""

import pytest
import torch

from megatron_rl_bi.bi.rmsnorm import ROWS_PER_PROGRAM, BatchInvariantRMSNorm

EPS = 1e-6


def _reference(x, weight, zero_centered):
    gamma = weight.double() + 1 if zero_centered else weight.double()
    x = x.double()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * gamma


@pytest.mark.parametrize("zero_centered", [False, True])
@pytest.mark.parametrize("rows,d", [(3, 8), (ROWS_PER_PROGRAM + 5, 96)])  # a partial dw block; D not 2**n
def test_forward_and_gradients_match_the_formula(rows, d, zero_centered):
    torch.manual_seed(0)
    x = torch.randn(rows, d, requires_grad=True)
    weight = (torch.rand(d) * 0.2).requires_grad_()
    dy = torch.randn(rows, d)
    ours = BatchInvariantRMSNorm.apply(x, weight, EPS, zero_centered)
    ours.backward(dy)
    x64, w64 = x.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    reference = _reference(x64, w64, zero_centered)
    reference.backward(dy.double())
    torch.testing.assert_close(ours.double(), reference.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(x.grad.double(), x64.grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(weight.grad.double(), w64.grad, rtol=1e-4, atol=1e-5)


def test_rows_alone_equal_the_batch():
    torch.manual_seed(0)
    x, weight = torch.randn(40, 48), torch.rand(48)
    full = BatchInvariantRMSNorm.apply(x, weight, EPS, False)
    for rows in (slice(0, 1), slice(5, 17), slice(39, 40)):
        assert torch.equal(BatchInvariantRMSNorm.apply(x[rows], weight, EPS, False), full[rows])


def test_leading_dimensions_and_empty_input():
    x, weight = torch.randn(2, 3, 16), torch.rand(16)
    out = BatchInvariantRMSNorm.apply(x, weight, EPS, False)
    assert out.shape == (2, 3, 16)
    assert torch.equal(out.reshape(6, 16), BatchInvariantRMSNorm.apply(x.reshape(6, 16), weight, EPS, False))
    assert BatchInvariantRMSNorm.apply(torch.empty(0, 16), weight, EPS, False).shape == (0, 16)


@pytest.fixture
def upstream_te_norm(monkeypatch):
    from megatron_rl_bi.bi import rmsnorm

    calls = []
    monkeypatch.setattr(rmsnorm, "UPSTREAM_TE_APPLY_NORMALIZATION", lambda *args: calls.append(args[7]) or "upstream")
    monkeypatch.setattr(rmsnorm._mcore_bik, "is_batch_invariant_mode_enabled", lambda: True)
    return calls


@pytest.mark.parametrize("preallocated", [False, True])
def test_te_fused_norm_returns_te_outputs_from_this_kernel(upstream_te_norm, preallocated):
    """TE's (ln_out, mu, rsigma): ln_out in the requested dtype, rsigma fp32 per row."""
    from megatron_rl_bi.bi.rmsnorm import te_apply_normalization

    torch.manual_seed(0)
    x, weight = torch.randn(5, 24), torch.rand(24)
    ln_out = torch.empty(5, 24, dtype=torch.float64) if preallocated else None
    out, mu, rsigma = te_apply_normalization(x, ln_out, weight, None, EPS, None, torch.float64, "RMSNorm", 0, True)
    assert mu is None and upstream_te_norm == [] and out.dtype == torch.float64
    assert out is ln_out if preallocated else out.shape == x.shape
    torch.testing.assert_close(out, _reference(x, weight, True), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(rsigma, torch.rsqrt(x.pow(2).mean(-1) + EPS), rtol=1e-6, atol=0)
    assert torch.equal(out.float(), BatchInvariantRMSNorm.apply(x, weight, EPS, True))


@pytest.mark.parametrize("normalization, bias, quantizer", [("LayerNorm", None, None), ("RMSNorm", 0, None),
                                                            ("RMSNorm", None, "fp8")])
def test_te_fused_norm_leaves_other_cases_to_megatron_core(upstream_te_norm, normalization, bias, quantizer):
    from megatron_rl_bi.bi.rmsnorm import te_apply_normalization

    x = torch.randn(2, 8)
    bias = None if bias is None else torch.zeros(8)
    assert te_apply_normalization(x, None, torch.ones(8), bias, EPS, quantizer, torch.float32, normalization, 0,
                                  False) == "upstream"
    assert upstream_te_norm == [normalization]
