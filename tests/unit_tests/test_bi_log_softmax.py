"""The split log-softmax (bi/log_softmax.py) on CPU, in the Triton interpreter: the same bits as
megatron-core's kernel there for every split of a row (the interpreter reduces a block as numpy
does, so this checks the schedule: block maxima, block sums, their sum in block order; the GPU
reduction tree is tests/gpu/test_bi_kernels.py's), and the routing."""

import pytest
import torch

from megatron_rl_bi.bi import log_softmax


@pytest.mark.parametrize("parts", [1, 2, 3, 5, 64])
def test_every_split_gives_megatron_cores_bits(parts):
    torch.manual_seed(0)
    x = torch.randn(3, 5000) * 4  # 5 blocks, the last one partial
    out = log_softmax.split_rows_log_softmax(x, parts)
    assert torch.equal(out, log_softmax.MCORE_LOG_SOFTMAX(x))
    # torch's CPU kernel sums in another order: within a few fp32 ulps of values up to ~25
    assert (out - torch.log_softmax(x, -1)).abs().max().item() < 1e-5


def test_a_row_of_one_block_and_extreme_values():
    x = torch.tensor([[0.0, -1e30, 50.0, 50.0], [1.0, 2.0, 3.0, 4.0]])
    out = log_softmax.split_rows_log_softmax(x, parts=4)
    assert torch.equal(out, log_softmax.MCORE_LOG_SOFTMAX(x))
    assert out[0, 2].item() == out[0, 3].item() == pytest.approx(-0.6931472)  # log(1/2)


def test_what_is_not_split_goes_to_megatron_core(monkeypatch):
    calls = []
    monkeypatch.setattr(log_softmax, "MCORE_LOG_SOFTMAX", lambda x, dim: calls.append((x.dtype, dim)) or x)
    log_softmax.log_softmax(torch.zeros(2, 8))  # CPU
    log_softmax.log_softmax(torch.zeros(2, 8, dtype=torch.bfloat16))
    log_softmax.log_softmax(torch.zeros(2, 8), dim=0)
    assert calls == [(torch.float32, -1), (torch.bfloat16, -1), (torch.float32, 0)]


def test_split_parts_by_row_count_and_length():
    # 132 SMs (the H200). A decode step's 32 rows of a 151,936 vocabulary (149 blocks of 1024):
    # ceil(4 * 132 / 32) = 17 programs a row; one row: 528; 131 rows: ceil(528 / 131) = 5.
    assert log_softmax.split_parts(32, 151_936, 132) == 17
    assert log_softmax.split_parts(1, 151_936, 132) == 528
    assert log_softmax.split_parts(131, 151_936, 132) == 5
    # As many rows as SMs, or rows of at most 64 blocks: megatron-core's kernel (one program a row).
    assert log_softmax.split_parts(132, 151_936, 132) == 1
    assert log_softmax.split_parts(32, 32_000, 132) == 1
    assert log_softmax.split_parts(32, 65_536, 132) == 1
    assert log_softmax.split_parts(32, 65_537, 132) == 17
