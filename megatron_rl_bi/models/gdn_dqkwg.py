"""The one step of fla's chunked gated-delta-rule backward that Triton miscompiles on Hopper, in
torch: the gradients of q, k, w and the log-decay g within each chunk (fla's `chunk_bwd_dqkwg`,
gated, with w and dv as the gated delta rule calls it).

fla 0.6.0 refuses that step on Hopper with Triton >= 3.4 and < 3.7.1 (fla issue 640: the
transposed product `ds^T @ q` is taken from an operand left in the wgmma accumulator layout), and
with it the whole chunked backward. The rest of that backward runs there, with this package's
Triton kernel of the step in its place (models/gdn_dqkwg_triton.py, installed by
`compat.replace_fla_gated_dqkwg`). This function is that kernel's reference: its tests compare the
two, and bench/gdn_rule.py times the backward with each.

Same arguments, layouts and arithmetic as fla's kernel: chunks of `chunk_size` tokens that never
cross a sequence, `h`/`dh` one [K, V] state per chunk and value head ([V, K] with
`state_v_first`), g in log2 units (powers of 2), q/k heads shared by HV // H value heads, dq and
dk summed over each group in the inputs' dtype. Products are taken in fp32 from operands rounded
to the inputs' dtype, as the kernel's tensor-core dots are (bf16 values are exact in fp32 and
TF32), and `ds` is rounded to that dtype before its two products, as there.
"""

import torch


def chunk_bounds(total: int, cu_seqlens, chunk_indices, batch: int, chunk_size: int, device):
    """Each chunk's first token and the end of its sequence (indices into the flattened B*T
    tokens), in the order fla numbers chunks (sequence after sequence, a chunk's states at that
    index of h and dh): packed, fla's own `chunk_indices` ([sequence, chunk of it] a row), made on
    the device as fla makes them where not given."""
    if cu_seqlens is None:
        length = total // batch
        per_sequence = -(-length // chunk_size)
        sequence = torch.arange(batch, device=device).repeat_interleave(per_sequence)
        chunk = torch.arange(per_sequence, device=device).repeat(batch)
        bos = sequence * length
        eos = bos + length
    else:
        if chunk_indices is None:
            from fla.ops.utils import prepare_chunk_indices

            chunk_indices = prepare_chunk_indices(cu_seqlens, chunk_size)
        sequence, chunk = chunk_indices[:, 0].long(), chunk_indices[:, 1].long()
        bos, eos = cu_seqlens.long()[sequence], cu_seqlens.long()[sequence + 1]
    return bos + chunk * chunk_size, eos


def _chunk_tokens(total: int, cu_seqlens, chunk_indices, batch: int, chunk_size: int, device):
    """[chunks, chunk_size] token indices (clamped), whether each is inside its sequence, and
    each chunk's last token."""
    starts, eos = chunk_bounds(total, cu_seqlens, chunk_indices, batch, chunk_size, device)
    index = starts[:, None] + torch.arange(chunk_size, device=device)
    inside = index < eos[:, None]
    last = torch.minimum(starts + chunk_size, eos) - 1
    return index.clamp(max=total - 1), inside, last


def check_gated_call(w, g, g_gamma, dv) -> None:
    if g is None or w is None or dv is None or g_gamma is not None:
        raise NotImplementedError("only the gated delta rule's call (g, w and dv; no g_gamma)")


def chunk_bwd_dqkwg(q, k, v, do, h, dh, w=None, g=None, g_gamma=None, dv=None, scale=None,
                    state_v_first=False, cu_seqlens=None, chunk_size=64, chunk_indices=None):
    """fla's `chunk_bwd_dqkwg` for the gated delta rule (g, w and dv given): (dq, dk, dw, dg)."""
    check_gated_call(w, g, g_gamma, dv)
    batch, total, heads, _ = k.shape
    value_heads, total = v.shape[2], batch * total
    index, inside, last = _chunk_tokens(total, cu_seqlens, chunk_indices, batch, chunk_size, q.device)

    def chunks(x):  # [B, T, heads, D] -> fp32 [chunks, chunk_size, HV, D], zero outside sequences
        x = x.reshape(total, *x.shape[2:])[index].float() * inside[..., None, None]
        return x if x.shape[2] == value_heads else x.repeat_interleave(value_heads // x.shape[2], dim=2)

    q_, k_, v_, do_, dv_ = (chunks(x) for x in (q, k, v, do, dv))
    h_, dh_ = (x.reshape(-1, value_heads, *x.shape[-2:]).float() for x in (h, dh))
    if state_v_first:
        h_, dh_ = h_.transpose(-1, -2), dh_.transpose(-1, -2)  # [chunks, HV, K, V]
    g_all = g.reshape(total, value_heads).float()
    g_, g_last = g_all[index] * inside[..., None], g_all[last]  # [chunks, chunk_size, HV], [chunks, HV]
    dw = -torch.einsum("cthv,chkv->cthk", dv_, _rounded(h_, h.dtype, v.dtype))
    dq = torch.einsum("cthv,chkv->cthk", do_, _rounded(h_, h.dtype, do.dtype)) * torch.exp2(g_)[..., None] * scale
    decay_to_end = torch.where(inside[..., None], torch.exp2(g_last[:, None] - g_), 0.0)
    dk = torch.einsum("cthv,chkv->cthk", v_, _rounded(dh_, dh.dtype, v.dtype)) * decay_to_end[..., None]
    dg_last = (h_ * dh_).sum((-1, -2)) * torch.exp2(g_last) + (dk * k_).sum((1, 3))
    g_heads = g_.transpose(1, 2)  # [chunks, HV, chunk_size]
    pairs = inside[:, :, None] & inside[:, None, :] & torch.ones(
        chunk_size, chunk_size, dtype=torch.bool, device=q.device).tril()  # [chunks, i, j], i >= j
    ds = torch.einsum("cihv,cjhv->chij", do_, v_) * torch.exp2(g_heads[..., :, None] - g_heads[..., None, :])
    ds = (torch.where(pairs[:, None], ds, 0.0) * scale).to(k.dtype).float()
    dq = dq + torch.einsum("chij,cjhk->cihk", ds, k_)
    dk = dk + torch.einsum("chij,cihk->cjhk", ds, q_)
    dg = (dq * q_).sum(-1) - (dk * k_).sum(-1)  # [chunks, chunk_size, HV]
    dg = dg + torch.where((index == last[:, None])[..., None], dg_last[:, None], 0.0)
    dq, dk = (group_sum(_scatter(x, index, inside, total, t.dtype), heads, batch) for x, t in ((dq, q), (dk, k)))
    return (dq, dk, _scatter(dw, index, inside, total, w.dtype).view(w.shape),
            _scatter(dg, index, inside, total, torch.float32).view(g.shape))


def _rounded(value, stored, dtype):
    """fp32 `value` (of a `stored`-dtype tensor) as the kernel casts it to `dtype` for a product."""
    return value if dtype in (stored, torch.float32) else value.to(dtype).float()


def _scatter(value, index, inside, total, dtype):
    """Chunked [chunks, chunk_size, HV, ...] back to the flattened tokens' order, in `dtype`."""
    flat = value.new_zeros(total, *value.shape[2:])
    flat[index[inside]] = value[inside]
    return flat.to(dtype)


def group_sum(value, heads, batch):
    """dq or dk of each value head summed over the heads that share a q/k head, as fla does."""
    total, value_heads, key_dim = value.shape
    return value.view(batch, total // batch, heads, value_heads // heads, key_dim).sum(3)
