"""BI mode's TransformerEngine GEMM (bi/te_gemm.py) on CPU, TE not needed: each of TE's three
layouts gives the product from views of its operands (no transposed copies), `accumulate` adds
into `out`, bias and bias gradient as megatron-core's patch has them, unsupported features
refused by name. The GEMM itself runs in the Triton interpreter (fp16; values within fp16
rounding of an fp32 product, not a bitwise claim: the bits are tests/gpu/test_te_kernels.py's)."""

import pytest
import torch

from megatron_rl_bi.bi import gemm, te_gemm


@pytest.fixture
def kernel_operands(monkeypatch):
    """The operands te_gemm hands the BI GEMM, which runs in the interpreter."""
    seen, kernel = [], gemm.matmul

    def recording(a, b, bias=None):
        seen.append((a, b))
        return kernel(a, b, bias)

    monkeypatch.setattr(gemm, "matmul", recording)
    return seen


def _randn(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).half()


def _close(out, reference):
    assert (out.float() - reference).abs().max().item() <= 2 ** -4  # fp16 rounding of values < 64


T, IN, OUT = 40, 96, 72
WEIGHT, X, DY = _randn(OUT, IN, seed=0), _randn(T, IN, seed=1), _randn(T, OUT, seed=2)


@pytest.mark.parametrize("layout, a, b, reference", [
    ("TN", WEIGHT, X, X.float() @ WEIGHT.float().T),      # forward: x @ W.T
    ("NN", WEIGHT, DY, DY.float() @ WEIGHT.float()),      # input gradient: dy @ W
    ("NT", X, DY, DY.float().T @ X.float()),              # weight gradient: dy.T @ x
])
def test_te_layouts_give_the_product_from_views(kernel_operands, layout, a, b, reference):
    out, bias_grad, *_ = te_gemm.general_gemm(a, b, layout=layout)
    _close(out, reference)
    assert bias_grad is None
    (rows, weight), = kernel_operands
    storages = {a.untyped_storage().data_ptr(), b.untyped_storage().data_ptr()}
    assert {rows.untyped_storage().data_ptr(), weight.untyped_storage().data_ptr()} == storages


def test_leading_dimensions_of_the_input_are_kept(kernel_operands):
    x = X.reshape(4, 10, IN)
    out, *_ = te_gemm.general_gemm(WEIGHT, x, layout="TN")
    assert out.shape == (4, 10, OUT)
    _close(out, x.float() @ WEIGHT.float().T)


def test_accumulate_adds_into_out_and_otherwise_overwrites(kernel_operands):
    """Gradient-accumulation fusion: TE passes main_grad (fp32) as `out` with accumulate=True."""
    main_grad = torch.full((OUT, IN), 0.5)
    result, *_ = te_gemm.general_gemm(X, DY, layout="NT", out=main_grad, out_dtype=torch.float32,
                                      accumulate=True, grad=True)
    assert result is main_grad
    _close(main_grad, 0.5 + DY.float().T @ X.float())
    te_gemm.general_gemm(X, DY, layout="NT", out=main_grad, out_dtype=torch.float32, grad=True)
    _close(main_grad, DY.float().T @ X.float())


def test_bias_after_rounding_and_bias_gradient(kernel_operands):
    bias = _randn(OUT, seed=3)
    out, bias_grad, *_ = te_gemm.general_gemm(WEIGHT, X, layout="TN", bias=bias)
    assert bias_grad is None
    assert torch.equal(out, te_gemm.general_gemm(WEIGHT, X, layout="TN")[0] + bias)
    _, bias_grad, *_ = te_gemm.general_gemm(X, DY, layout="NT", bias=bias, grad=True)
    assert torch.equal(bias_grad, DY.sum(dim=0))


def test_out_dtype(kernel_operands):
    out, *_ = te_gemm.general_gemm(WEIGHT, X, layout="TN", out_dtype=torch.float32)
    assert out.dtype == torch.float32


@pytest.mark.parametrize("feature, kwargs", [
    ("quantization_params", {"quantization_params": object()}),
    ("gelu", {"gelu": True}),
    ("alpha", {"alpha": 2.0}),
    ("beta", {"beta": 0.5}),
    ("Userbuffers", {"bulk_overlap": True}),
])
def test_unsupported_features_are_refused_by_name(feature, kwargs):
    with pytest.raises(NotImplementedError, match=feature):
        te_gemm.general_gemm(WEIGHT, X, **kwargs)


def test_the_weight_gradient_of_an_unflattened_input(kernel_operands):
    """TE's Linear keeps its [s, b, h] input for the weight gradient: flattened as a view."""
    x = X.reshape(4, 10, IN)
    out, *_ = te_gemm.general_gemm(x, DY, layout="NT")
    _close(out, DY.float().T @ X.float())
    (rows, weight), = kernel_operands
    assert weight.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()


def test_no_autograd_graph_even_for_operands_that_require_grad(monkeypatch):
    """As TE's own GEMM: a delayed weight gradient run with grad on must not hang a graph on main_grad."""
    monkeypatch.setattr(gemm, "matmul", lambda a, b, bias=None: a.float() @ b.float())  # records autograd
    main_grad = torch.zeros(OUT, IN)
    x = X.clone().requires_grad_()
    te_gemm.general_gemm(x, DY, layout="NT", out=main_grad, out_dtype=torch.float32, accumulate=True, grad=True)
    assert main_grad.grad_fn is None and not main_grad.requires_grad


def test_fp32_operands_go_to_megatron_cores_version(monkeypatch):
    calls = []
    monkeypatch.setattr(te_gemm, "UPSTREAM", lambda *args, **kwargs: calls.append(kwargs) or ("y", None, None, None))
    assert te_gemm.general_gemm(WEIGHT.float(), X.float(), layout="TN")[0] == "y"
    assert calls == [{"out_dtype": None, "layout": "TN", "bias": None, "grad": False}]
