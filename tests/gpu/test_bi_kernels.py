"""One torch.equal test per batch-invariant kernel used: rows of a batch == the rows alone."""

import pytest
import torch

from megatron_rl_bi import bi
from megatron_rl_bi.bi import log_softmax

from .conftest import FLASH_ATTENTION_VERSION

pytestmark = pytest.mark.gpu


@pytest.fixture
def bi_on():
    with bi.batch_invariant():
        yield


def _rows_alone_equal(fn, x, row_groups):
    full = fn(x)
    for rows in row_groups:
        assert torch.equal(fn(x[rows]), full[rows]), f"rows {rows} differ from the full batch"


def test_matmul_rows_invariant(bi_on):
    torch.manual_seed(0)
    a = torch.randn(4096, 2048, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(1408, 2048, device="cuda", dtype=torch.bfloat16)
    linear = lambda x: torch.nn.functional.linear(x, w)  # noqa: E731
    _rows_alone_equal(linear, a, [slice(0, 1), slice(5, 12), slice(100, 1100), slice(4095, 4096)])


def test_full_mean_is_the_mean(bi_on):
    """A full mean reaches BI mode's `mean.dim` override with no dims (bi/mean.py); the verify
    report's top-1 agreement is one."""
    x = torch.tensor([[1.0, 2.0], [3.0, 4.0]], device="cuda")
    assert x.mean().item() == 2.5
    assert (x > 1).float().mean().item() == 0.75
    assert x.bfloat16().mean().dtype == torch.bfloat16


@pytest.mark.parametrize("zero_centered", [False, True])
@pytest.mark.parametrize("d", [2048, 2560, 8192])
def test_rms_norm_rows_invariant(bi_on, d, zero_centered):
    torch.manual_seed(0)
    x = torch.randn(3000, d, device="cuda", dtype=torch.bfloat16)
    weight = torch.rand(d, device="cuda", dtype=torch.bfloat16) + 0.5
    norm = lambda rows: bi.rms_norm(rows, weight, 1e-5, zero_centered)  # noqa: E731
    _rows_alone_equal(norm, x, [slice(0, 1), slice(7, 300), slice(2999, 3000)])


@pytest.mark.parametrize("zero_centered", [False, True])
def test_rms_norm_forward_and_backward_close_to_the_default_mode(zero_centered):
    """Not a bitwise claim (another reduction order than F.rms_norm): output, dx and dw (all
    bf16) within 1e-2 relative L2, a few bf16 roundings (2**-9 each)."""
    torch.manual_seed(0)
    x = torch.randn(4096, 2048, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    weight = (torch.rand(2048, device="cuda") * 0.2).bfloat16().requires_grad_()
    dy = torch.randn(4096, 2048, device="cuda", dtype=torch.bfloat16)
    results = []
    for on in (True, False):
        with bi.batch_invariant(on):
            out = bi.rms_norm(x, weight, 1e-6, zero_centered)
        dx, dw = torch.autograd.grad(out, (x, weight), dy)
        results.append([t.float() for t in (out, dx, dw)])
    for name, ours, theirs in zip(("output", "dx", "dw"), *results):
        assert (ours - theirs).norm() / theirs.norm() < 1e-2, name


@pytest.mark.parametrize("vocab", [151_936, 32_000, 4_097, 1_000])
def test_split_log_softmax_has_megatron_cores_bits(vocab):
    """A decode step's few long rows run bi/log_softmax.py's split kernel, the trainer's many rows
    and short rows megatron-core's: a token's logprob is the same either way only if the bits are."""
    torch.manual_seed(0)
    x = torch.randn(131, vocab, device="cuda") * 8
    reference = log_softmax.MCORE_LOG_SOFTMAX(x)
    for parts in (1, 2, 9, 64, 200):
        assert torch.equal(log_softmax.split_rows_log_softmax(x, parts), reference), parts
    for rows in (1, 32, 131):
        assert torch.equal(log_softmax.log_softmax(x[:rows]), reference[:rows]), rows


def test_selective_log_softmax_rows_invariant(bi_on):
    torch.manual_seed(0)
    logits = torch.randn(2500, 32000, device="cuda", dtype=torch.bfloat16) * 3
    tokens = torch.randint(0, 32000, (2500,), device="cuda")
    full = bi.selective_log_softmax(logits, tokens)
    for rows in (slice(0, 1), slice(3, 700), slice(2499, 2500)):
        assert torch.equal(bi.selective_log_softmax(logits[rows], tokens[rows]), full[rows])


def test_flash_attention_packed_equals_alone(bi_on):
    """The trainer's core attention: a sequence packed with others == the sequence alone."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_rl_bi.attention import FlashCoreAttention

    config = TransformerConfig(
        num_layers=1, hidden_size=512, num_attention_heads=8, num_query_groups=2, bf16=True,
        flash_attention_version=int(FLASH_ATTENTION_VERSION), params_dtype=torch.bfloat16, attention_dropout=0.0,
    )
    attention = FlashCoreAttention(config, 1, None, "self")
    torch.manual_seed(0)
    lengths = [1, 37, 500, 129]
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    total = sum(lengths)
    q = torch.randn(total, 8, 64, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(total, 2, 64, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(total, 2, 64, device="cuda", dtype=torch.bfloat16)
    from megatron.core.packed_seq_params import PackedSeqParams

    def run(cu_seqlens, max_len, rows):
        params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens,
                                 max_seqlen_q=max_len, max_seqlen_kv=max_len)
        return attention(q[rows], k[rows], v[rows], None, packed_seq_params=params)

    packed = run(cu, max(lengths), slice(0, total))
    for i, length in enumerate(lengths):
        rows = slice(int(cu[i]), int(cu[i + 1]))
        alone = run(torch.tensor([0, length], dtype=torch.int32, device="cuda"), length, rows)
        assert torch.equal(alone, packed[rows]), f"sequence {i} (length {length}) differs"
