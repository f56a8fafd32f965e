"""Rotary position embedding in one kernel a call, with the bits of megatron-core's unfused rope.

megatron-core's local (non-TE) layers apply rope with `rope_utils._apply_rotary_pos_emb_bshd`:
cos and sin of the frequencies, scaled and rounded to the input's dtype, then `t * cos +
rotate_half(t) * sin` and a concatenation, each its own kernel (about a dozen for q and as many
for k, every layer, in every engine step and trainer forward; as many again backward). Here cos
and sin are taken as there, by torch (the same values by construction), and the rest is one
kernel: every product and the sum rounded to the input's dtype as torch rounds each op's
result, no fused multiply-add. Forward and backward keep megatron-core's bits
(tests/unit_tests/test_fused_rope.py, interpreted; tests/gpu/test_fused_rope.py).

Taken for CUDA tensors with the plain rotate-half layout; interleaved layouts and CPU tensors run
megatron-core's function. Installed when a model is built (`use_fused_rope`, models/build.py);
bench/rope.py times it against megatron-core's.
"""

import torch
import triton
import triton.language as tl


@triton.jit
def _rope_kernel(t, cos, sin, out, batch, heads, stride_s, stride_b, stride_h,
                 DIM: tl.constexpr, ROT: tl.constexpr, HEADS_BLOCK: tl.constexpr,
                 HALF_BLOCK: tl.constexpr, PASS_BLOCK: tl.constexpr, BACKWARD: tl.constexpr):
    """One row (a token of one batch entry), all heads. Forward: out = t * cos + rotate_half(t) *
    sin; backward (t is the output's gradient): its transpose, as autograd computes it."""
    row = tl.program_id(0).to(tl.int64)
    o_h = tl.arange(0, HEADS_BLOCK)
    o_i = tl.arange(0, HALF_BLOCK)
    m_i = o_i < ROT // 2
    mask = (o_h < heads)[:, None] & m_i[None, :]
    dtype = out.dtype.element_ty
    angle = (row // batch) * ROT + o_i
    c1 = tl.load(cos + angle, mask=m_i, other=0.0).to(tl.float32)
    c2 = tl.load(cos + angle + ROT // 2, mask=m_i, other=0.0).to(tl.float32)
    s1 = tl.load(sin + angle, mask=m_i, other=0.0).to(tl.float32)
    s2 = tl.load(sin + angle + ROT // 2, mask=m_i, other=0.0).to(tl.float32)
    source = t + (row // batch) * stride_s + (row % batch) * stride_b + o_h[:, None] * stride_h
    x1 = tl.load(source + o_i[None, :], mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(source + ROT // 2 + o_i[None, :], mask=mask, other=0.0).to(tl.float32)
    if BACKWARD:  # d/dx1 = g1 c1 + g2 s2; d/dx2 = g2 c2 - g1 s1 (each product rounded, then the sum)
        y1 = (x1 * c1[None, :]).to(dtype).to(tl.float32) + (x2 * s2[None, :]).to(dtype).to(tl.float32)
        y2 = (x2 * c2[None, :]).to(dtype).to(tl.float32) - (x1 * s1[None, :]).to(dtype).to(tl.float32)
    else:  # rotate_half(t) = [-x2, x1]
        y1 = (x1 * c1[None, :]).to(dtype).to(tl.float32) + (-x2 * s1[None, :]).to(dtype).to(tl.float32)
        y2 = (x2 * c2[None, :]).to(dtype).to(tl.float32) + (x1 * s2[None, :]).to(dtype).to(tl.float32)
    target = out + row * heads * DIM + o_h[:, None] * DIM
    tl.store(target + o_i[None, :], y1.to(dtype), mask=mask)
    tl.store(target + ROT // 2 + o_i[None, :], y2.to(dtype), mask=mask)
    if PASS_BLOCK > 0:  # the dimensions past the rotary ones pass through
        o_p = ROT + tl.arange(0, PASS_BLOCK)
        m_p = (o_h < heads)[:, None] & (o_p < DIM)[None, :]
        tl.store(target + o_p[None, :], tl.load(source + o_p[None, :], mask=m_p), mask=m_p)


def _cos_sin(freqs: torch.Tensor, mscale: float, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """megatron-core's `cos_` and `sin_` ([s, rot] in the input's dtype); x * 1.0 is x."""
    cos, sin = torch.cos(freqs), torch.sin(freqs)
    if mscale != 1.0:
        cos, sin = cos * mscale, sin * mscale
    return (x.to(dtype).reshape(freqs.shape[0], freqs.shape[-1]).contiguous() for x in (cos, sin))


def _launch(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backward: bool) -> torch.Tensor:
    """t: [s, b, heads, dim]; cos, sin: [s, rot] in t's dtype."""
    seq, batch, heads, dim = t.shape
    rot = cos.shape[-1]
    if t.stride(-1) != 1:
        t = t.contiguous()
    out = torch.empty(seq, batch, heads, dim, dtype=t.dtype, device=t.device)
    pass_dims = dim - rot
    _rope_kernel[(seq * batch,)](
        t, cos, sin, out, batch, heads, t.stride(0), t.stride(1), t.stride(2), DIM=dim, ROT=rot,
        HEADS_BLOCK=triton.next_power_of_2(heads), HALF_BLOCK=triton.next_power_of_2(rot // 2),
        PASS_BLOCK=triton.next_power_of_2(pass_dims) if pass_dims else 0, BACKWARD=backward,
        enable_fp_fusion=False)
    return out


class _FusedRope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, freqs, mscale):
        cos, sin = _cos_sin(freqs, mscale, t.dtype)
        ctx.save_for_backward(cos, sin)
        return _launch(t, cos, sin, backward=False)

    @staticmethod
    def backward(ctx, grad):
        return _launch(grad, *ctx.saved_tensors, backward=True), None, None


def fused_rope(t: torch.Tensor, freqs: torch.Tensor, mscale: float = 1.0) -> torch.Tensor:
    """megatron-core's `_apply_rotary_pos_emb_bshd(t, freqs, mscale=mscale)` (rotate-half layout)
    in one kernel: t [s, b, heads, dim], freqs [s, 1, 1, rot] with an even rot <= dim."""
    return _FusedRope.apply(t, freqs, mscale)


def _fusable(t, freqs, rotary_interleaved, mla_rotary_interleaved, multi_latent_attention) -> bool:
    return (t.is_cuda and t.dim() == 4 and freqs.dim() == 4 and freqs.dtype == torch.float32
            and freqs.shape[0] == t.shape[0] and freqs.shape[1] == freqs.shape[2] == 1 and freqs.shape[-1] % 2 == 0
            and freqs.shape[-1] <= t.shape[-1] and not rotary_interleaved and not mla_rotary_interleaved
            and not multi_latent_attention)


def use_fused_rope() -> None:
    """megatron-core's unfused rope (`rope_utils._apply_rotary_pos_emb_bshd`, which its packed
    path calls too) runs as `fused_rope` where it can. Idempotent."""
    from megatron.core.models.common.embeddings import rope_utils

    upstream = rope_utils._apply_rotary_pos_emb_bshd
    if hasattr(upstream, "upstream"):
        return

    def rope(t, freqs, rotary_interleaved=False, mla_rotary_interleaved=False, mscale=1.0,
             multi_latent_attention=None):
        if _fusable(t, freqs, rotary_interleaved, mla_rotary_interleaved, multi_latent_attention):
            return fused_rope(t, freqs, mscale)
        return upstream(t, freqs, rotary_interleaved, mla_rotary_interleaved, mscale, multi_latent_attention)

    rope.upstream = upstream
    rope_utils._apply_rotary_pos_emb_bshd = rope


def megatron_cores_rope():
    """megatron-core's own `_apply_rotary_pos_emb_bshd`, whether or not `use_fused_rope` has run
    in this process (every model build runs it): the reference of the bitwise tests and of
    bench/rope.py."""
    from megatron.core.models.common.embeddings import rope_utils

    current = rope_utils._apply_rotary_pos_emb_bshd
    return getattr(current, "upstream", current)
