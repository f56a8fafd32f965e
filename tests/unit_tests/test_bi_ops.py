import pytest
import torch
from megatron.core.transformer.custom_layers import batch_invariant_kernels as mcore_bik
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_rl_bi import bi
from megatron_rl_bi.bi.rmsnorm import BatchInvariantRMSNorm
from megatron_rl_bi.models.norm import RMSNorm


@pytest.fixture
def log_softmax_calls(monkeypatch, cpu_dispatch):
    """Counts calls reaching megatron-core's BI log_softmax (which then runs its Triton kernel;
    on CPU in the Triton interpreter)."""
    calls = []
    real = mcore_bik._log_softmax_batch_invariant

    def counting(input, dim, half_to_float):
        calls.append(tuple(input.shape))
        return real(input, dim, half_to_float)

    monkeypatch.setattr(mcore_bik, "_log_softmax_batch_invariant", counting)
    yield calls
    bi.disable()


def test_selective_log_softmax_values_and_chunking():
    torch.manual_seed(0)
    logits = torch.randn(10, 37, dtype=torch.bfloat16)
    tokens = torch.randint(0, 37, (10,))
    expected = torch.log_softmax(logits.float(), -1).gather(-1, tokens[:, None]).squeeze(-1)
    out = bi.selective_log_softmax(logits, tokens, chunk_rows=3)
    assert out.dtype == torch.float32
    assert torch.equal(out, expected)  # same kernel per row, chunking only slices rows


def test_selective_log_softmax_gradient_matches_autograd():
    torch.manual_seed(0)
    logits = torch.randn(6, 11, dtype=torch.float64, requires_grad=True)
    tokens = torch.randint(0, 11, (6,))
    weights = torch.randn(6, dtype=torch.float64)
    (bi.selective_log_softmax(logits, tokens, chunk_rows=4) * weights).sum().backward()
    ref_logits = logits.detach().clone().requires_grad_(True)
    ref = torch.log_softmax(ref_logits, -1).gather(-1, tokens[:, None]).squeeze(-1)
    (ref * weights).sum().backward()
    # the forward is fp32 by design; tolerance is fp32 rounding of the softmax
    assert torch.allclose(logits.grad, ref_logits.grad, atol=1e-6)


def test_selective_log_softmax_rejects_bad_shapes():
    with pytest.raises(ValueError, match=r"logits \[T, V\]"):
        bi.selective_log_softmax(torch.zeros(2, 3, 4), torch.zeros(2, dtype=torch.long))


def test_bi_selective_log_softmax_rows_are_batch_invariant(log_softmax_calls):
    """Batch of N vs each row alone through megatron-core's BI Triton kernel: torch.equal."""
    torch.manual_seed(0)
    logits = torch.randn(9, 3000, dtype=torch.bfloat16) * 4
    tokens = torch.randint(0, 3000, (9,))
    with bi.batch_invariant():
        batched = bi.selective_log_softmax(logits, tokens)
        alone = torch.cat([bi.selective_log_softmax(logits[i : i + 1], tokens[i : i + 1]) for i in range(9)])
    assert log_softmax_calls, "BI mode did not reach megatron-core's log_softmax kernel"
    assert torch.equal(batched, alone)


def _config(**kw):
    return TransformerConfig(
        num_layers=1, hidden_size=8, num_attention_heads=1, normalization="RMSNorm", **kw
    )


def test_rms_norm_default_mode_matches_the_formula():
    torch.manual_seed(0)
    norm = RMSNorm(_config(), hidden_size=8, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(0.5, 2.0, 8))
    x = torch.randn(4, 8)
    expected = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * norm.weight
    assert torch.allclose(norm(x), expected, atol=1e-6)  # fp32 rounding only


def test_rms_norm_zero_centered_gamma():
    norm = RMSNorm(_config(layernorm_zero_centered_gamma=True), hidden_size=8)
    x = torch.randn(3, 8)
    assert torch.equal(norm.weight, torch.zeros(8))
    expected = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)
    assert torch.allclose(norm(x), expected, atol=1e-6)


def test_zero_centered_default_mode_adds_one_in_fp32():
    """transformers' Qwen3.5 norm: x and 1 + weight in fp32, then the output dtype. The bf16
    weight + 1 rounded in bf16 would lose the weight's low bits (1 + 2**-9 is not a bf16)."""
    torch.manual_seed(0)
    norm = RMSNorm(_config(layernorm_zero_centered_gamma=True), hidden_size=8)
    with torch.no_grad():
        norm.weight.copy_(torch.full((8,), 2.0 ** -9))
    x = torch.randn(3, 8).bfloat16()
    xf = x.float()
    expected = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5) * (1 + 2.0 ** -9)).bfloat16()
    # F.rms_norm and this formula may round the fp32 statistic differently: one bf16 ulp at most
    assert torch.allclose(norm(x).float(), expected.float(), rtol=2 ** -8, atol=0)


def test_rms_norm_uses_the_bi_kernel_when_switched_on(monkeypatch):
    seen = []
    monkeypatch.setattr(BatchInvariantRMSNorm, "apply", lambda *args: seen.append(args) or args[0])
    norm = RMSNorm(_config(), hidden_size=8, eps=1e-6)
    x = torch.randn(2, 8)
    with bi.batch_invariant():
        norm(x)
    norm(x)
    assert len(seen) == 1 and seen[0][2] == 1e-6 and seen[0][3] is False


def test_rms_norm_rejects_layernorm_config():
    with pytest.raises(ValueError, match="--normalization LayerNorm"):
        RMSNorm(
            TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1), hidden_size=8
        )


@pytest.mark.parametrize("temperature", [0.7, 1.3])
def test_selective_log_softmax_at_a_temperature(temperature):
    """Values: log softmax of the logits divided by the temperature, rounded to fp32 first as the
    engine's request metadata holds it; gradients: autograd of that function."""
    torch.manual_seed(0)
    logits = torch.randn(6, 11, dtype=torch.bfloat16)
    tokens = torch.randint(0, 11, (6,))
    t32 = torch.tensor(temperature, dtype=torch.float32).item()
    expected = torch.log_softmax(logits.float().clone().div_(t32), -1)[torch.arange(6), tokens]
    assert torch.equal(bi.selective_log_softmax(logits, tokens, chunk_rows=4, temperature=temperature),
                       expected)
    exact = torch.randn(6, 11, dtype=torch.float64, requires_grad=True)
    weights = torch.randn(6, dtype=torch.float64)
    (bi.selective_log_softmax(exact, tokens, temperature=temperature) * weights).sum().backward()
    reference = exact.detach().clone().requires_grad_(True)
    (torch.log_softmax(reference / t32, -1)[torch.arange(6), tokens] * weights).sum().backward()
    assert torch.allclose(exact.grad, reference.grad, atol=1e-6)  # fp32 inside: not bitwise
    with pytest.raises(ValueError, match="temperature 0 must be > 0"):
        bi.selective_log_softmax(logits, tokens, temperature=0)
