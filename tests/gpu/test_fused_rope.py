"""models/rope.fused_rope on the GPU, bf16: megatron-core's unfused rope bit for bit, forward and
backward (torch.equal), at Qwen3-4B's heads (32 query, 8 key-value, head dim 128) in a packed
trainer batch and a decode step's rows, with q and k as the strided views the fused qkv projection
gives; and megatron-core's rope routed through it once installed."""

import pytest
import torch
from megatron.core.models.common.embeddings import rope_utils

from megatron_rl_bi.models import rope

pytestmark = pytest.mark.gpu

UPSTREAM = rope.megatron_cores_rope()


def _freqs(positions, rotary_dim=128, base=1_000_000):
    inv = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, device="cuda").float() / rotary_dim))
    freqs = torch.outer(positions.float(), inv)
    return torch.cat([freqs, freqs], dim=-1)[:, None, None, :]


def _rope_and_grad(fn, t, freqs, mscale):
    t = t.detach().clone().requires_grad_(True)
    out = fn(t, freqs, mscale=mscale)
    out.backward(torch.randn(out.shape, device="cuda", generator=torch.Generator("cuda").manual_seed(1)).to(out.dtype))
    return out.detach(), t.grad


@pytest.mark.parametrize("tokens, positions", [
    (10240, lambda n: torch.arange(n, device="cuda") % 8192),  # a packed trainer batch
    (64, lambda n: torch.randint(4096, 8192, (n,), device="cuda")),  # a decode step, long contexts
])
@pytest.mark.parametrize("mscale", [1.0, 1.25])
def test_equals_megatron_cores_rope_in_bf16(tokens, positions, mscale):
    torch.manual_seed(0)
    qkv = torch.randn(tokens, 1, 8, 6, 128, device="cuda").bfloat16()  # 8 groups of 4 q, k, v
    q, k = qkv[:, :, :, :4].flatten(2, 3), qkv[:, :, :, 4]
    freqs = _freqs(positions(tokens))
    for t in (q, k):
        ours, ours_grad = _rope_and_grad(rope.fused_rope, t, freqs, mscale)
        theirs, theirs_grad = _rope_and_grad(UPSTREAM, t, freqs, mscale)
        assert torch.equal(ours, theirs) and torch.equal(ours_grad, theirs_grad)


def test_megatron_cores_rope_takes_the_kernel_once_installed(monkeypatch):
    monkeypatch.setattr(rope_utils, "_apply_rotary_pos_emb_bshd", UPSTREAM)
    rope.use_fused_rope()
    calls = []
    monkeypatch.setattr(rope, "fused_rope", lambda *args: calls.append(1) or UPSTREAM(args[0], args[1]))
    t = torch.randn(16, 1, 4, 128, device="cuda").bfloat16()
    rope_utils._apply_rotary_pos_emb_bshd(t, _freqs(torch.arange(16, device="cuda")))
    assert calls == [1]
