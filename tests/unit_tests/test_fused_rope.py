"""models/rope.fused_rope gives megatron-core's unfused rope (`_apply_rotary_pos_emb_bshd`) bit for
bit, forward and backward (torch.equal), run by the Triton interpreter: full and partial rotary,
a scale, a batch, an input that is a strided slice (as q and k are of the fused qkv projection).
In fp16 and fp32: the interpreter rounds fp32 to bf16 by truncation where the GPU rounds to
nearest, so bf16 is the GPU test's (tests/gpu/test_fused_rope.py); fp16 has the same rounding
points."""

import pytest
import torch
from megatron.core.models.common.embeddings import rope_utils

from megatron_rl_bi.models import rope

UPSTREAM = rope.megatron_cores_rope()


def _freqs(positions, rotary_dim):
    inv = 1.0 / (10000 ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim))
    freqs = torch.outer(positions.float(), inv)
    return torch.cat([freqs, freqs], dim=-1)[:, None, None, :]  # [s, 1, 1, rotary_dim]


def _rope_and_grad(fn, t, freqs, mscale):
    t = t.detach().clone().requires_grad_(True)
    out = fn(t, freqs, mscale=mscale)
    out.backward(torch.arange(out.numel()).reshape(out.shape).sin().to(out.dtype))
    return out.detach(), t.grad


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("rotary_dim", [32, 8])  # full and partial rotary
@pytest.mark.parametrize("mscale", [1.0, 1.25])
def test_equals_megatron_cores_rope(dtype, rotary_dim, mscale):
    torch.manual_seed(0)
    qkv = torch.randn(9, 2, 3, 5, 32).to(dtype)  # [s, b, groups, (q, q, q, k, v), dim]
    q = qkv[:, :, :, :3].flatten(2, 3)  # contiguous: flattening the strided slice copies it
    k = qkv[:, :, :, 3]  # a strided view: heads 5 * 32 apart
    freqs = _freqs(torch.tensor([0, 1, 2, 700, 5, 9, 4000, 3, 8]), rotary_dim)
    for t in (q, k):
        ours, ours_grad = _rope_and_grad(rope.fused_rope, t, freqs, mscale)
        theirs, theirs_grad = _rope_and_grad(UPSTREAM, t, freqs, mscale)
        assert torch.equal(ours, theirs) and torch.equal(ours_grad, theirs_grad)
        assert not torch.equal(ours, t)


def test_only_cuda_tensors_in_the_rotate_half_layout_take_the_kernel(monkeypatch):
    monkeypatch.setattr(rope_utils, "_apply_rotary_pos_emb_bshd", UPSTREAM)
    rope.use_fused_rope()
    rope.use_fused_rope()  # idempotent
    assert rope_utils._apply_rotary_pos_emb_bshd.upstream is UPSTREAM
    assert rope.megatron_cores_rope() is UPSTREAM  # the reference, installed or not
    t, freqs = torch.zeros(4, 1, 2, 8), torch.zeros(4, 1, 1, 8)
    assert rope._fusable(t.to("meta"), freqs, False, False, None) is False  # not CUDA
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    assert rope._fusable(t, freqs, False, False, None)
    assert not rope._fusable(t, freqs, True, False, None)  # interleaved
    assert not rope._fusable(t, freqs, False, True, None)  # MLA's interleaving
    assert not rope._fusable(t, freqs[:1], False, False, None)  # frequencies broadcast over positions
    assert not rope._fusable(t, freqs.bfloat16(), False, False, None)  # cos taken in another dtype
