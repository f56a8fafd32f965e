"""The BI GEMM's logic on CPU (Triton interpreter, fp16: the interpreter mis-reads bf16 through
tensor descriptors): every operand layout, bias, K and N tails, the tile picked by M, the
fallback to megatron-core's kernel. Values are compared with an fp32 product within fp16
rounding of the output (not a bitwise claim: torch's CPU GEMM is another kernel); the bitwise
claims (rows independent of M, every tile config the same bits) are GPU tests
(tests/gpu/test_bi_gemm.py)."""

import pytest
import torch

from megatron_rl_bi.bi import gemm


def _operands(m, k, n, seed=0):
    generator = torch.Generator().manual_seed(seed)
    a = torch.randn(m, k, generator=generator).half()
    b = torch.randn(k, n, generator=generator).half()
    return a, b


def _close(out, reference):
    # fp16 output: half an ulp of the largest |value| (< 64 here) is 2 ** -5
    assert (out.float() - reference).abs().max().item() <= 2 ** -5


def _column_major(t):
    return t.T.contiguous().T


@pytest.mark.parametrize("a_column_major", [False, True])
@pytest.mark.parametrize("b_column_major", [False, True])
def test_every_layout_gives_the_product(a_column_major, b_column_major):
    a, b = _operands(72, 96, 136)  # K and N not multiples of the tile: zero-filled tails
    reference = a.float() @ b.float()
    out = gemm.matmul(_column_major(a) if a_column_major else a, _column_major(b) if b_column_major else b)
    assert out.shape == (72, 136) and out.dtype == torch.float16
    _close(out, reference)


@pytest.mark.parametrize("block_k", [64, 128, 256])
def test_every_k_block_gives_the_product(block_k):
    a, b = _operands(40, 296, 96)  # K not a multiple of any block: zero-filled K tail
    out = gemm.matmul(a, _column_major(b), config=gemm.TileConfig(64, 32, 3, 4, block_k))
    _close(out, a.float() @ b.float())


def test_bias_is_added_in_fp32_before_rounding():
    a, b = _operands(8, 64, 128)
    bias = torch.randn(128).half()
    _close(gemm.matmul(a, b, bias), a.float() @ b.float() + bias.float())


def test_rows_of_a_small_batch_equal_the_same_rows_of_a_large_one():
    a, b = _operands(304, 128, 64)
    assert gemm.tile_config(3, 64) != gemm.tile_config(304, 64)
    assert torch.equal(gemm.matmul(a[:3], b), gemm.matmul(a, b)[:3])


def test_tile_picked_by_m_and_n():
    assert [gemm.tile_config(m, 2048).block_m for m in (1, 64, 65, 256, 257, 100_000)] == [64, 64, 128, 128, 128, 128]
    assert [gemm.tile_config(m, 2048).block_n for m in (1, 64, 65, 100_000)] == [64, 64, 128, 256]
    # Decode rows: 128 columns a program from N = 8192 (the MLP's first linear), 256 for the LM head.
    assert [gemm.tile_config(32, n).block_n for n in (4096, 8191, 8192, 65_535, 151_936)] == [64, 64, 128, 128, 256]
    assert [gemm.tile_config(32, n).block_k for n in (4096, 8192, 151_936)] == [256, 128, 64]
    assert gemm.tile_config(65, 151_936).block_n == 128  # not a decode size: the M rule alone


def test_empty_and_k0_products():
    assert gemm.matmul(torch.zeros(0, 64).half(), torch.zeros(64, 128).half()).shape == (0, 128)
    bias = torch.arange(128.0).half()
    assert torch.equal(gemm.matmul(torch.zeros(8, 0).half(), torch.zeros(0, 128).half(), bias),
                       bias.expand(8, 128))


def test_what_tma_cannot_describe_goes_to_megatron_core(monkeypatch):
    calls = []
    monkeypatch.setattr(gemm, "MCORE_MATMUL", lambda a, b, bias: calls.append(a.shape) or a.float() @ b.float())
    a, b = _operands(8, 60, 128)  # a's row stride: 120 bytes, not a multiple of 16
    gemm.matmul(a, b)
    gemm.matmul(a.float(), b.float()[:60])  # fp32
    a, b = _operands(128, 64, 60)
    gemm.matmul(a, _column_major(b))  # the output's row stride: 120 bytes (an MoE router's 60 experts)
    assert calls == [(8, 60), (8, 60), (128, 64)]


def test_mismatched_operands_are_refused():
    with pytest.raises(ValueError, match=r"matmul of \(8, 64\) torch.float16 and \(32, 128\)"):
        gemm.matmul(torch.zeros(8, 64).half(), torch.zeros(32, 128).half())
