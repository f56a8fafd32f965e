"""The TMA GEMM (megatron_rl_bi.bi.gemm) on the GPU, bf16: rows independent of M in every
layout the model's forward and backward use, every tile config the same bits, and the product
within bf16 rounding of cuBLAS's."""

import pytest
import torch

from megatron_rl_bi.bi import gemm

pytestmark = pytest.mark.gpu

ROW_GROUPS = [slice(0, 1), slice(5, 12), slice(100, 1100), slice(4095, 4096)]


def _operands(m, k, n):
    torch.manual_seed(0)
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
    return a, b


@pytest.mark.parametrize("b_column_major", [False, True])  # x @ W.T (forward), dY @ W (dgrad)
def test_rows_alone_equal_the_full_batch(b_column_major):
    a, b = _operands(4096, 2048, 1408)
    if b_column_major:
        b = b.T.contiguous().T
    bias = torch.randn(1408, device="cuda", dtype=torch.bfloat16)
    full = gemm.matmul(a, b, bias)
    for rows in ROW_GROUPS:
        assert torch.equal(gemm.matmul(a[rows], b, bias), full[rows]), f"rows {rows}"


def test_every_tile_config_gives_the_same_bits():
    a, b = _operands(1000, 4096, 3072)
    results = [gemm.matmul(a, b, config=config) for _, config in gemm.TILE_CONFIGS]
    assert all(torch.equal(results[0], r) for r in results[1:])


def test_column_major_a_weight_gradient_layout():
    """dW = dY.T @ X: A is column-major; the reduction runs over the tokens."""
    dy, x = _operands(8192, 1024, 2048)
    dw = gemm.matmul(dy.T, x)
    reference = dy.T.float() @ x.float()
    assert (dw.float() - reference).norm() / reference.norm() < 1e-2


def test_close_to_cublas():
    """Not a bitwise claim (cuBLAS splits K its own way): bf16 output rounding, relative L2."""
    a, b = _operands(3000, 2048, 5632)
    ours, theirs = gemm.matmul(a, b), a @ b
    assert (ours.float() - theirs.float()).norm() / theirs.float().norm() < 1e-2
