"""The TMA GEMM (megatron_rl_bi.bi.gemm) on the GPU, bf16: rows independent of M in every
layout the model's forward and backward use, every tile config the same bits, the same bits as
megatron-core's kernel in every layout (so what TMA cannot describe may go to it, and the BI
results of earlier commits stand), the same bits from a replayed CUDA graph, and the product
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
    results = [gemm.matmul(a, b, config=config) for *_, config in gemm.TILE_CONFIGS]
    assert all(torch.equal(results[0], r) for r in results[1:])


def test_column_major_a_weight_gradient_layout():
    """dW = dY.T @ X: A is column-major; the reduction runs over the tokens."""
    torch.manual_seed(0)
    dy = torch.randn(8192, 1024, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(8192, 2048, device="cuda", dtype=torch.bfloat16)
    dw = gemm.matmul(dy.T, x)
    reference = dy.T.float() @ x.float()
    assert (dw.float() - reference).norm() / reference.norm() < 1e-2


# (M, K, N) and layout: forward x @ W.T, input gradient dY @ W, weight gradient dY.T @ X.
LAYOUTS = {
    "forward": lambda a, b: (a, b.T.contiguous().T),
    "input_gradient": lambda a, b: (a, b),
    "weight_gradient": lambda a, b: (a.T.contiguous().T, b),
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("m", [1, 32, 200, 3000])
def test_same_bits_as_megatron_cores_kernel(layout, m):
    a, b = LAYOUTS[layout](*_operands(m, 2048, 1408))
    assert torch.equal(gemm.matmul(a, b), gemm.MCORE_MATMUL(a, b))


def test_replayed_graph_rewrites_its_descriptors_for_new_inputs():
    """Each program writes its descriptors into scratch memory the capture allocated; a replay
    after the inputs change in place gives the eager product's bits."""
    a, b = LAYOUTS["forward"](*_operands(32, 2048, 4096))
    gemm.matmul(a, b)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = gemm.matmul(a, b)
    a.copy_(torch.randn_like(a))
    graph.replay()
    assert torch.equal(captured, gemm.matmul(a, b))


def test_close_to_cublas():
    """Not a bitwise claim (cuBLAS splits K its own way): bf16 output rounding, relative L2."""
    a, b = _operands(3000, 2048, 5632)
    ours, theirs = gemm.matmul(a, b), a @ b
    assert (ours.float() - theirs.float()).norm() / theirs.float().norm() < 1e-2


def test_grouped_rows_equal_each_experts_own_product():
    """The experts' grouped GEMM (bi/grouped_gemm.py) at Qwen3-30B-A3B's expert widths: each
    expert's rows the bits of the BI GEMM on that expert alone, for experts of no rows, of one
    part tile and of several tiles (whose own products take other tile configs)."""
    from megatron_rl_bi.bi import grouped_gemm

    torch.manual_seed(0)
    counts = torch.randint(0, 12, (128,))
    counts[:8] = torch.tensor([0, 1, 63, 64, 65, 200, 300, 1000])
    for k, n in ((2048, 1536), (768, 2048)):  # linear_fc1 (gate and up), linear_fc2
        rows = torch.randn(int(counts.sum()), k, device="cuda", dtype=torch.bfloat16)
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / 32 for _ in counts]
        out = grouped_gemm.grouped_matmul(rows, grouped_gemm.WeightTable()(weights), weights[0].shape,
                                          counts.cuda())
        expected = [gemm.matmul(part, w.T) for part, w in zip(torch.split(rows, counts.tolist()), weights)]
        for expert, (got, want) in enumerate(zip(torch.split(out, counts.tolist()), expected)):
            assert torch.equal(got, want), f"expert {expert} ({counts[expert]} rows), K {k}"


def test_no_weight_table_is_made_while_a_graph_is_captured():
    """A table made inside a capture would be read from an address the graph keeps: refused."""
    from megatron_rl_bi.bi import grouped_gemm

    weights = [torch.zeros(64, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    with pytest.raises(RuntimeError, match="moved while a CUDA graph is captured"):
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            grouped_gemm.WeightTable()(weights)
