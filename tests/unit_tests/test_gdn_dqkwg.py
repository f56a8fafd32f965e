"""models/gdn_dqkwg.chunk_bwd_dqkwg (the torch step) against fla's own kernel (`chunk_bwd_kernel_dqkwg`, run by the
Triton interpreter on CPU) on the gated delta rule's call: packed sequences (a chunk-aligned
boundary, a one-token sequence, a partial last chunk), a batch without packing, value heads
sharing q/k heads, both state layouts. fp32 inputs: the interpreter's bf16 products are not the
GPU's (its results there are not finite), so dtype rounding is the GPU test's (tests/gpu/
test_gdn_backward.py). Tolerance: fp32 rounding of two summation orders (relative 1e-6; seen
<= 2e-7). Then this package's Triton kernel (models/gdn_dqkwg_triton.py, the interpreter too)
against the torch step on the same calls, at key widths of one, two and a partial key block."""

import pytest
import torch

from megatron_rl_bi.models.gdn_dqkwg import chunk_bwd_dqkwg
from megatron_rl_bi.numerics import relative_l2_error

CHUNK = 64


CALLS = [
    (200, 2, 4, [0, 70, 200], False, 1),
    (200, 2, 2, [0, 64, 200], True, 1),
    (300, 1, 2, [0, 1, 100, 300], False, 1),
    (130, 1, 2, None, False, 2),
]


def _call(tokens, heads, value_heads, cu_seqlens, state_v_first, batch=1, key_dim=32, value_dim=16):
    from fla.ops.utils import prepare_chunk_indices

    gen = torch.Generator().manual_seed(0)
    chunk_indices = None if cu_seqlens is None else prepare_chunk_indices(cu_seqlens, CHUNK)
    chunks = -(-tokens // CHUNK) if cu_seqlens is None else len(chunk_indices)  # per batch row
    state_shape = (batch, chunks, value_heads, *((value_dim, key_dim) if state_v_first else (key_dim, value_dim)))

    def rand(*shape):
        return torch.randn(*shape, generator=gen)

    return dict(q=rand(batch, tokens, heads, key_dim), k=rand(batch, tokens, heads, key_dim),
                v=rand(batch, tokens, value_heads, value_dim), do=rand(batch, tokens, value_heads, value_dim),
                h=rand(*state_shape), dh=rand(*state_shape), w=rand(batch, tokens, value_heads, key_dim),
                dv=rand(batch, tokens, value_heads, value_dim),
                g=-0.05 * torch.rand(batch, tokens, value_heads, generator=gen).cumsum(1),
                scale=0.3, cu_seqlens=cu_seqlens, chunk_indices=chunk_indices, state_v_first=state_v_first)


@pytest.mark.parametrize("tokens, heads, value_heads, cu_seqlens, state_v_first, batch", CALLS)
def test_equals_flas_kernel(single_config_autotune, tokens, heads, value_heads, cu_seqlens, state_v_first, batch):
    from fla.ops.common.chunk_o import chunk_bwd_dqkwg as fla_chunk_bwd_dqkwg

    cu = None if cu_seqlens is None else torch.tensor(cu_seqlens)
    kwargs = _call(tokens, heads, value_heads, cu, state_v_first, batch)
    expected = fla_chunk_bwd_dqkwg(**kwargs)
    got = chunk_bwd_dqkwg(**kwargs)
    if cu is not None:  # fla passes its chunk numbering; without it, the same chunks are made here
        assert all(torch.equal(a, b) for a, b in zip(chunk_bwd_dqkwg(**{**kwargs, "chunk_indices": None}), got))
    for name, want, have in zip(("dq", "dk", "dw", "dg"), expected, got):
        assert have.shape == want.shape and have.dtype == want.dtype, name
        assert relative_l2_error(have, want) <= 1e-6, name


@pytest.mark.parametrize("key_dim, value_dim", [(32, 16), (128, 128), (96, 64)])  # key blocks of 64
@pytest.mark.parametrize("tokens, heads, value_heads, cu_seqlens, state_v_first, batch", CALLS)
def test_the_kernel_equals_the_torch_step(tokens, heads, value_heads, cu_seqlens, state_v_first, batch,
                                          key_dim, value_dim):
    from megatron_rl_bi.models.gdn_dqkwg_triton import chunk_bwd_dqkwg as kernel

    cu = None if cu_seqlens is None else torch.tensor(cu_seqlens)
    kwargs = _call(tokens, heads, value_heads, cu, state_v_first, batch, key_dim, value_dim)
    for name, want, have in zip(("dq", "dk", "dw", "dg"), chunk_bwd_dqkwg(**kwargs), kernel(**kwargs)):
        assert have.shape == want.shape and have.dtype == want.dtype, name
        assert relative_l2_error(have, want) <= 1e-6, name


@pytest.mark.parametrize("step", ["torch", "kernel"])
def test_only_the_gated_delta_rules_call(step):
    from megatron_rl_bi.models import gdn_dqkwg_triton

    call = {"torch": chunk_bwd_dqkwg, "kernel": gdn_dqkwg_triton.chunk_bwd_dqkwg}[step]
    kwargs = _call(64, 1, 1, None, False)
    with pytest.raises(NotImplementedError, match="gated delta rule"):
        call(**{**kwargs, "w": None})


def test_operands_are_rounded_to_the_products_dtype_as_the_kernel_casts_them():
    from megatron_rl_bi.models.gdn_dqkwg import _rounded

    fp32_state = torch.tensor([1 + 2**-10])  # not a bf16 value: bf16 keeps 7 fraction bits
    assert torch.equal(_rounded(fp32_state, torch.float32, torch.bfloat16), torch.tensor([1.0]))
    assert torch.equal(_rounded(fp32_state, torch.float32, torch.float32), fp32_state)
    bf16_state = torch.tensor([1 + 2**-7])
    assert _rounded(bf16_state, torch.bfloat16, torch.bfloat16) is bf16_state  # already of its values


def test_lifting_fla_refusal_measures_flas_own_step(monkeypatch):
    """bench/gdn_rule.py times fla's refused backward with the guard lifted: that backward must then
    run fla's own chunk_bwd_dqkwg, not a step installed in its place, and get it back after."""
    import fla.ops.common.chunk_o as chunk_o
    import fla.ops.gated_delta_rule.chunk as gated_delta_rule_chunk

    from megatron_rl_bi import compat

    monkeypatch.setattr(gated_delta_rule_chunk, "chunk_bwd_dqkwg", gated_delta_rule_chunk.chunk_bwd_dqkwg)
    monkeypatch.setattr(chunk_o, "TRITON_ABOVE_3_7_1", False)
    compat.replace_fla_gated_dqkwg(chunk_bwd_dqkwg)
    with compat.fla_hopper_backward_guard_lifted():
        assert gated_delta_rule_chunk.chunk_bwd_dqkwg is chunk_o.chunk_bwd_dqkwg and chunk_o.TRITON_ABOVE_3_7_1
    assert gated_delta_rule_chunk.chunk_bwd_dqkwg is chunk_bwd_dqkwg and not chunk_o.TRITON_ABOVE_3_7_1
