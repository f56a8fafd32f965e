"""The experts' grouped GEMM (bi/grouped_gemm.py) on the CPU, in the Triton interpreter (fp16):
each expert's rows times its own weight, for experts of no rows, of a part tile and of several
tiles, with N and K tails; the tile schedule's bound; the weight table. Values are compared with
fp32 products within fp16 rounding, and with the BI GEMM's bits where K fits one K step (the
interpreter's dot sums each K step at once); the bitwise claim at real widths is a GPU test
(tests/gpu/test_bi_gemm.py)."""

import torch

from megatron_rl_bi.bi import gemm, grouped_gemm


def _experts(counts, k, n, seed=0):
    generator = torch.Generator().manual_seed(seed)
    rows = torch.randn(sum(counts), k, generator=generator).half()
    weights = [(torch.randn(n, k, generator=generator) / 4).half() for _ in counts]
    out = grouped_gemm.grouped_matmul(rows, grouped_gemm.WeightTable()(weights), weights[0].shape,
                                      torch.tensor(counts))
    return rows, weights, out


def test_each_experts_rows_times_its_own_weight():
    counts = [3, 0, 70, 1, 0, 130, 64]  # part tiles, none, two and three tiles, one whole tile
    rows, weights, out = _experts(counts, k=96, n=136)  # K and N not multiples of the tile
    assert out.shape == (sum(counts), 136) and out.dtype == torch.float16
    expected = torch.cat([part.float() @ w.float().T for part, w in zip(torch.split(rows, counts), weights)])
    # fp16 output: half an ulp of the largest |value| (< 16 here) is 2 ** -7
    assert expected.abs().max() < 16 and (out.float() - expected).abs().max() <= 2 ** -7


def test_the_rows_bits_are_the_bi_gemms_on_each_expert_alone():
    counts = [5, 64, 0, 100, 1]
    rows, weights, out = _experts(counts, k=64, n=128)  # one K step: the interpreter sums it at once
    for got, part, w in zip(torch.split(out, counts), torch.split(rows, counts), weights):
        assert torch.equal(got, gemm.matmul(part, w.T))


def test_the_tile_bound_covers_every_expert_ending_in_a_part_tile():
    """cdiv(R, 64) + E - 1 tiles: here 4 part tiles of 1 row and one of 60 take 5 tiles, the bound
    cdiv(64, 64) + 5 - 1 = 5; one tile fewer would leave the last expert's rows unwritten."""
    counts = [1, 1, 1, 1, 60]
    assert sum(-(-c // grouped_gemm.BLOCK_M) for c in counts) == -(-sum(counts) // 64) + len(counts) - 1
    rows, weights, out = _experts(counts, k=32, n=16)
    expected = torch.cat([part.float() @ w.float().T for part, w in zip(torch.split(rows, counts), weights)])
    assert (out.float() - expected).abs().max() <= 2 ** -7


def test_no_rows_and_the_weight_table_follows_the_weights():
    table = grouped_gemm.WeightTable()
    weights = [torch.zeros(8, 4).half() for _ in range(3)]
    first = table(weights)
    assert first.tolist() == [w.data_ptr() for w in weights] and table(weights) is first
    weights[1] = torch.zeros(8, 4).half()
    assert table(weights).tolist() == [w.data_ptr() for w in weights]
    out = grouped_gemm.grouped_matmul(torch.zeros(0, 4).half(), table(weights), weights[0].shape,
                                      torch.zeros(3, dtype=torch.int64))
    assert out.shape == (0, 8)


def test_what_the_kernel_takes():
    half = [torch.zeros(8, 4).half(), torch.zeros(8, 4).half()]
    assert grouped_gemm.groupable(half, torch.float16, torch.device("cpu"))
    assert not grouped_gemm.groupable(half, torch.float32, torch.device("cpu"))
    assert not grouped_gemm.groupable([half[0], torch.zeros(4, 8).half()], torch.float16, torch.device("cpu"))
    assert not grouped_gemm.groupable([half[0], torch.zeros(4, 8).half().T], torch.float16, torch.device("cpu"))
