"""BI mode's TransformerEngine pieces on the GPU (TE itself not needed). The GEMM (bi/te_gemm.py):
in each of TE's layouts, at token counts TMA can and cannot describe after megatron-core's
transposed copies, the same bits as megatron-core's `BatchInvariantTEGemmFn` (only the copies
and the slow-kernel fallback go). The fused-norm forward (bi/rmsnorm.te_apply_normalization):
rows independent of the batch (torch.equal), and within a bf16 rounding of megatron-core's patch
(not bitwise: its row mean is another reduction; engine and trainer both run this one)."""

import pytest
import torch
from megatron.core.transformer.custom_layers import batch_invariant_kernels as _mcore_bik

from megatron_rl_bi import bi
from megatron_rl_bi.bi import rmsnorm, te_gemm

pytestmark = pytest.mark.gpu

IN, OUT = 2048, 3072


@pytest.fixture
def bi_on():
    with bi.batch_invariant():
        yield


@pytest.mark.parametrize("tokens", [4096, 4093])  # 4093: megatron-core's dy.T copy is misaligned
@pytest.mark.parametrize("layout", ["TN", "NN", "NT", "NT, [s, b, h] input"])
def test_same_bits_as_megatron_cores_te_gemm(bi_on, layout, tokens):
    torch.manual_seed(0)
    weight = torch.randn(OUT, IN, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(tokens, IN, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(tokens, OUT, device="cuda", dtype=torch.bfloat16)
    a, b = {"TN": (weight, x), "NN": (weight, dy), "NT": (x, dy),
            "NT, [s, b, h] input": (x.view(tokens, 1, IN), dy)}[layout]
    ours, *_ = te_gemm.general_gemm(a, b, layout=layout[:2], out_dtype=torch.bfloat16)
    upstream = _mcore_bik.BatchInvariantTEGemmFn.apply(a, b, None, torch.bfloat16, layout[:2])
    assert torch.equal(ours, upstream)


def test_accumulate_into_an_fp32_main_grad(bi_on):
    torch.manual_seed(0)
    x = torch.randn(4093, IN, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(4093, OUT, device="cuda", dtype=torch.bfloat16)
    main_grad = torch.randn(OUT, IN, device="cuda")
    expected = main_grad + te_gemm.general_gemm(x, dy, layout="NT", out_dtype=torch.float32)[0]
    te_gemm.general_gemm(x, dy, layout="NT", out=main_grad, out_dtype=torch.float32, accumulate=True)
    assert torch.equal(main_grad, expected)


def _te_norm(x, weight, patch=rmsnorm.te_apply_normalization):
    return patch(x, None, weight, None, 1e-6, None, torch.bfloat16, "RMSNorm", 0, False)


def test_te_fused_norm_rows_alone_and_close_to_megatron_core(bi_on):
    torch.manual_seed(0)
    x = torch.randn(3000, 2048, device="cuda", dtype=torch.bfloat16)
    weight = torch.rand(2048, device="cuda", dtype=torch.bfloat16)
    out, _, rsigma = _te_norm(x, weight)
    for rows in (slice(0, 1), slice(7, 300), slice(2999, 3000)):
        assert torch.equal(_te_norm(x[rows], weight)[0], out[rows])
    upstream, _, upstream_rsigma = _te_norm(x, weight, _mcore_bik._te_apply_normalization_patched)
    torch.testing.assert_close(rsigma, upstream_rsigma, rtol=1e-5, atol=0)
    assert (out.float() - upstream.float()).abs().max() <= upstream.float().abs().max() * 2 ** -8
