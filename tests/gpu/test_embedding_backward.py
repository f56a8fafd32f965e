"""The embedding's weight gradient in BI mode (bi/embedding.py), on the GPU: the tiny search
recipe's warm-up shape (about 6,200 indices a step over a 128-row vocabulary, skewed as text is)
gives the same bits every time, torch's two-pass kernel's; where torch already ran a
deterministic kernel (3,072 indices or fewer), BI mode keeps its bits."""

import pytest
import torch

from megatron_rl_bi import bi

pytestmark = pytest.mark.gpu

ROWS, WIDTH = 128, 256


def _skewed_indices(count: int) -> torch.Tensor:
    """Character-like: a few rows very frequent, most rare."""
    generator = torch.Generator().manual_seed(0)
    weights = 1.0 / torch.arange(1, ROWS + 1, dtype=torch.float64) ** 1.2
    return torch.multinomial(weights, count, replacement=True, generator=generator).cuda()


def _weight_grad(indices: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    weight = torch.zeros(ROWS, WIDTH, device="cuda", dtype=grad.dtype, requires_grad=True)
    torch.nn.functional.embedding(indices, weight).backward(grad)
    return weight.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_gradient_repeats_and_is_torchs_two_pass_kernels(dtype):
    indices = _skewed_indices(6200)
    grad = torch.randn(6200, WIDTH, device="cuda", dtype=dtype, generator=torch.Generator("cuda").manual_seed(1))
    with bi.embedding.deterministic_algorithms():
        two_pass = _weight_grad(indices, grad)
    with bi.batch_invariant():
        assert all(torch.equal(_weight_grad(indices, grad), two_pass) for _ in range(50))
    if dtype == torch.float32:  # the fused kernel's fp32 atomics: why the override exists
        assert not all(torch.equal(_weight_grad(indices, grad), two_pass) for _ in range(50)), (
            "torch's default kernel now gives the two-pass bits here: bi/embedding.py may be removable")


def test_a_case_torch_ran_deterministically_keeps_its_bits():
    indices = _skewed_indices(3000)
    grad = torch.randn(3000, WIDTH, device="cuda", dtype=torch.bfloat16, generator=torch.Generator("cuda").manual_seed(2))
    stock = _weight_grad(indices, grad)
    with bi.batch_invariant():
        assert torch.equal(_weight_grad(indices, grad), stock)
