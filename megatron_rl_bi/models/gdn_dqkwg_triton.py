"""fla's gated `chunk_bwd_dqkwg` step as a Triton kernel that Triton 3.4-3.7.0 compiles correctly
on Hopper: the same step as models/gdn_dqkwg.py (in torch, its reference), one program
per (chunk, key block, value head) instead of some forty torch kernels over fp32 copies of every
input.

fla's kernel is miscompiled there because it multiplies by the transpose of `ds`, a tensor left
in the wgmma accumulator's register layout (fla issue 640). This kernel never transposes an
accumulator: it accumulates `ds^T` by its own products from the loaded `v` and `do` (transposing
loaded tiles, as fla's kernel also does without harm), one more [chunk, chunk] product per value
block. Its arithmetic is otherwise the reference's: products of operands in the inputs' dtype
accumulated in fp32, `ds` rounded to that dtype before its two products, powers of 2 for the
decay.

Installed where fla refuses its own step (models/gdn_rule.py). Triton 3.6 has miscompiled other
fla kernels on Hopper at this chunk size (fla issues 640 and 984), so tests/gpu/test_gdn_backward.py
holds it to the torch step on a real backward's arguments; bench/gdn_rule.py times the backward
with each.
"""

import torch
import triton
import triton.language as tl

from megatron_rl_bi.models.gdn_dqkwg import check_gated_call, chunk_bounds, group_sum

KEY_BLOCK = 64  # with the chunk's five fp32 accumulators, what 4 warps hold without spilling
VALUE_BLOCK = 64
NUM_WARPS = 4


@triton.jit
def _products_over_values(v, h, do, dh, dv, token, m_t, o_k, state, i_h, HV: tl.constexpr, K: tl.constexpr,
                          V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                          STATE_V_FIRST: tl.constexpr):
    """A chunk's products summed over the value dimension, a block of it at a time: do h^T, v dh^T,
    dv h^T ([BT, BK]), do v^T and v do^T ([BT, BT]), and the sum of h * dh."""
    b_dq = tl.zeros([BT, BK], dtype=tl.float32)
    b_dk = tl.zeros([BT, BK], dtype=tl.float32)
    b_dw = tl.zeros([BT, BK], dtype=tl.float32)
    b_ds = tl.zeros([BT, BT], dtype=tl.float32)  # [i, j]: do_i . v_j
    b_ds_t = tl.zeros([BT, BT], dtype=tl.float32)  # [j, i]: the same products, never a transposed accumulator
    b_dg_last = tl.zeros([1], dtype=tl.float32)
    for i_v in range(tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_tv = m_t[:, None] & (o_v < V)[None, :]
        rows_v = token[:, None] * (HV * V) + i_h * V + o_v[None, :]
        b_v = tl.load(v + rows_v, mask=m_tv, other=0.0)
        b_do = tl.load(do + rows_v, mask=m_tv, other=0.0)
        b_dv = tl.load(dv + rows_v, mask=m_tv, other=0.0)
        if STATE_V_FIRST:
            in_state = o_v[:, None] * K + o_k[None, :]
        else:
            in_state = o_v[:, None] + o_k[None, :] * V
        m_vk = (o_v < V)[:, None] & (o_k < K)[None, :]
        b_h = tl.load(h + state + in_state, mask=m_vk, other=0.0)  # [BV, BK]
        b_dh = tl.load(dh + state + in_state, mask=m_vk, other=0.0)
        b_dg_last += tl.sum(b_h.to(tl.float32) * b_dh.to(tl.float32))
        b_ds = tl.dot(b_do, tl.trans(b_v), b_ds)
        b_ds_t = tl.dot(b_v, tl.trans(b_do), b_ds_t)
        b_dq = tl.dot(b_do, b_h.to(b_do.dtype), b_dq)
        b_dk = tl.dot(b_v, b_dh.to(b_v.dtype), b_dk)
        b_dw = tl.dot(b_dv.to(b_v.dtype), b_h.to(b_v.dtype), b_dw)
    return b_dq, b_dk, b_dw, b_ds, b_ds_t, b_dg_last


# `total` (the batch's tokens) only offsets dg's rows and varies from call to call: unspecialized,
# one variant per width, with the machine code of its multiple-of-16 compile (CPU test).
@triton.jit(do_not_specialize=["total"])
def _dqkwg_kernel(q, k, v, g, h, do, dh, dv, dq, dk, dw, dg, chunk_start, chunk_end, scale, total,
                  H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
                  BK: tl.constexpr, BV: tl.constexpr, STATE_V_FIRST: tl.constexpr):
    i_c, i_k, i_h = tl.program_id(0).to(tl.int64), tl.program_id(1), tl.program_id(2).to(tl.int64)
    start = tl.load(chunk_start + i_c)
    length = tl.minimum(tl.load(chunk_end + i_c) - start, BT)
    o_t = tl.arange(0, BT)
    m_t = o_t < length
    token = start + o_t
    o_k = i_k * BK + tl.arange(0, BK)
    m_tk = m_t[:, None] & (o_k < K)[None, :]
    b_dq, b_dk, b_dw, b_ds, b_ds_t, b_dg_last = _products_over_values(
        v, h, do, dh, dv, token, m_t, o_k, (i_c * HV + i_h) * K * V, i_h, HV, K, V, BT, BK, BV, STATE_V_FIRST)

    rows_hk = token[:, None] * (HV * K) + i_h * K + o_k[None, :]
    tl.store(dw + rows_hk, -b_dw.to(dw.dtype.element_ty), mask=m_tk)
    rows_qk = token[:, None] * (H * K) + (i_h // (HV // H)) * K + o_k[None, :]
    b_q = tl.load(q + rows_qk, mask=m_tk, other=0.0)
    b_k = tl.load(k + rows_qk, mask=m_tk, other=0.0)
    b_g = tl.load(g + token * HV + i_h, mask=m_t, other=0.0)
    b_g_last = tl.load(g + (start + length - 1) * HV + i_h)

    b_dg_last *= tl.exp2(b_g_last)
    b_dq = b_dq * tl.exp2(b_g)[:, None] * scale
    b_dk = b_dk * tl.where(m_t, tl.exp2(b_g_last - b_g), 0)[:, None]
    b_dg_last += tl.sum(b_dk * b_k.to(tl.float32))
    both = m_t[:, None] & m_t[None, :]
    b_ds = tl.where((o_t[:, None] >= o_t[None, :]) & both, b_ds * tl.exp2(b_g[:, None] - b_g[None, :]), 0) * scale
    b_ds_t = tl.where((o_t[None, :] >= o_t[:, None]) & both, b_ds_t * tl.exp2(b_g[None, :] - b_g[:, None]), 0) * scale
    b_dq = tl.dot(b_ds.to(b_k.dtype), b_k, b_dq)
    b_dk = tl.dot(b_ds_t.to(b_q.dtype), b_q, b_dk)
    b_dg = tl.sum(b_dq * b_q.to(tl.float32), axis=1) - tl.sum(b_dk * b_k.to(tl.float32), axis=1)
    b_dg = tl.where(o_t == length - 1, b_dg + b_dg_last, b_dg)
    tl.store(dq + rows_hk, b_dq.to(dq.dtype.element_ty), mask=m_tk)
    tl.store(dk + rows_hk, b_dk.to(dk.dtype.element_ty), mask=m_tk)
    tl.store(dg + i_k * total * HV + token * HV + i_h, b_dg, mask=m_t)


def chunk_bwd_dqkwg(q, k, v, do, h, dh, w=None, g=None, g_gamma=None, dv=None, scale=None,
                    state_v_first=False, cu_seqlens=None, chunk_size=64, chunk_indices=None):
    """fla's `chunk_bwd_dqkwg` for the gated delta rule (g, w and dv given): (dq, dk, dw, dg)."""
    check_gated_call(w, g, g_gamma, dv)
    batch, tokens, heads, key_dim = k.shape
    value_heads, value_dim, total = v.shape[2], v.shape[3], batch * tokens
    starts, ends = chunk_bounds(total, cu_seqlens, chunk_indices, batch, chunk_size, q.device)
    key_block = min(max(triton.next_power_of_2(key_dim), 16), KEY_BLOCK)
    key_blocks = triton.cdiv(key_dim, key_block)
    dq = q.new_zeros(batch, tokens, value_heads, key_dim)
    dk = torch.zeros_like(dq)
    dw = torch.zeros_like(w)
    dg = torch.zeros(key_blocks, *g.shape, dtype=torch.float32, device=g.device)
    contiguous = [x.contiguous() for x in (q, k, v, g, h, do, dh, dv)]
    _dqkwg_kernel[(len(starts), key_blocks, value_heads)](
        *contiguous, dq, dk, dw, dg, starts, ends, scale, total,
        H=heads, HV=value_heads, K=key_dim, V=value_dim, BT=chunk_size, BK=key_block,
        BV=min(max(triton.next_power_of_2(value_dim), 16), VALUE_BLOCK), STATE_V_FIRST=state_v_first,
        num_warps=NUM_WARPS)
    dq, dk = (group_sum(x.view(total, value_heads, key_dim), heads, batch) for x in (dq, dk))
    return dq, dk, dw, dg.sum(0)
