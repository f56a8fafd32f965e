"""BI mode's TransformerEngine GEMM (bi/te_gemm.py; TE itself not needed) on the GPU: in each of
TE's layouts, at token counts TMA can and cannot describe after megatron-core's transposed
copies, the same bits as megatron-core's `BatchInvariantTEGemmFn` (the TE BI route's bits are
unchanged; only the copies and the slow-kernel fallback go)."""

import pytest
import torch
from megatron.core.transformer.custom_layers import batch_invariant_kernels as _mcore_bik

from megatron_rl_bi import bi
from megatron_rl_bi.bi import te_gemm

pytestmark = pytest.mark.gpu

IN, OUT = 2048, 3072


@pytest.fixture
def bi_on():
    with bi.batch_invariant():
        yield


@pytest.mark.parametrize("tokens", [4096, 4093])  # 4093: megatron-core's dy.T copy is misaligned
@pytest.mark.parametrize("layout", ["TN", "NN", "NT"])
def test_same_bits_as_megatron_cores_te_gemm(bi_on, layout, tokens):
    torch.manual_seed(0)
    weight = torch.randn(OUT, IN, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(tokens, IN, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(tokens, OUT, device="cuda", dtype=torch.bfloat16)
    a, b = {"TN": (weight, x), "NN": (weight, dy), "NT": (x, dy)}[layout]
    ours, *_ = te_gemm.general_gemm(a, b, layout=layout, out_dtype=torch.bfloat16)
    upstream = _mcore_bik.BatchInvariantTEGemmFn.apply(a, b, None, torch.bfloat16, layout)
    assert torch.equal(ours, upstream)


def test_accumulate_into_an_fp32_main_grad(bi_on):
    torch.manual_seed(0)
    x = torch.randn(4093, IN, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(4093, OUT, device="cuda", dtype=torch.bfloat16)
    main_grad = torch.randn(OUT, IN, device="cuda")
    expected = main_grad + te_gemm.general_gemm(x, dy, layout="NT", out_dtype=torch.float32)[0]
    te_gemm.general_gemm(x, dy, layout="NT", out=main_grad, out_dtype=torch.float32, accumulate=True)
    assert torch.equal(main_grad, expected)
