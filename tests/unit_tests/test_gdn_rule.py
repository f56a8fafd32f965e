"""The BI gated delta rule on CPU: fla's recurrent kernel (Triton interpreter) forward, chunked
backward. Gradients are compared with autograd through fla's pure-PyTorch recurrent reference in
fp32 (tolerance: fp32 rounding of two evaluation orders, atol 2e-4 relative to O(1) values)."""

import pytest
import torch
from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule
from fla.ops.gated_delta_rule.naive import naive_recurrent_gated_delta_rule

from megatron_rl_bi.models import gdn_rule
from megatron_rl_bi.models.gdn_rule import gated_delta_rule


def _inputs(batch, length, heads=2, dk=16, dv=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, length, heads, dk, generator=gen)
    k = torch.nn.functional.normalize(torch.randn(batch, length, heads, dk, generator=gen), dim=-1)
    v = torch.randn(batch, length, heads, dv, generator=gen)
    g = -torch.rand(batch, length, heads, generator=gen) * 0.5  # log decay
    beta = torch.rand(batch, length, heads, generator=gen)
    return q, k, v, g, beta


def _reference(q, k, v, g, beta, initial_state):
    return naive_recurrent_gated_delta_rule(q, k, v, beta, g, initial_state=initial_state,
                                            output_final_state=True)


@pytest.mark.parametrize("length", [5, 70])  # one partial chunk; more than one 64-token chunk
def test_forward_and_gradients_match_the_reference(length):
    inputs = [t.requires_grad_(True) for t in _inputs(2, length)]
    state0 = (torch.randn(2, 2, 16, 16) * 0.1).requires_grad_(True)
    out, state = gated_delta_rule(*inputs, initial_state=state0, output_final_state=True)
    ref_inputs = [t.detach().clone().requires_grad_(True) for t in inputs]
    ref_state0 = state0.detach().clone().requires_grad_(True)
    ref_out, ref_state = _reference(*ref_inputs, ref_state0)
    assert torch.allclose(out, ref_out, atol=2e-4) and torch.allclose(state, ref_state, atol=2e-4)
    d_out, d_state = torch.randn_like(out), torch.randn_like(state)
    torch.autograd.backward([out, state], [d_out, d_state])
    torch.autograd.backward([ref_out, ref_state], [d_out, d_state])
    for name, mine, ref in zip(["q", "k", "v", "g", "beta", "state0"], [*inputs, state0],
                               [*ref_inputs, ref_state0]):
        assert torch.allclose(mine.grad, ref.grad, atol=2e-4, rtol=1e-3), name


def test_varlen_gradients_match_per_sequence_reference():
    """Packed sequences (zero-padded into one batch by the torch backward) with their own initial
    states: outputs, final states and every gradient match each sequence alone."""
    lengths = [3, 70, 1]
    cu = torch.tensor([0, 3, 73, 74])
    q, k, v, g, beta = (t.requires_grad_(True) for t in _inputs(1, sum(lengths)))
    state0 = (torch.randn(3, 2, 16, 16) * 0.1).requires_grad_(True)
    out, state = gated_delta_rule(q, k, v, g, beta, initial_state=state0, output_final_state=True,
                                  cu_seqlens=cu)
    d_out, d_state = torch.randn_like(out), torch.randn_like(state)
    torch.autograd.backward([out, state], [d_out, d_state])
    for i, (start, end) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        rows = slice(start, end)
        parts = [t.detach()[:, rows].clone().requires_grad_(True) for t in (q, k, v, g, beta)]
        ref_state0 = state0.detach()[i : i + 1].clone().requires_grad_(True)
        ref_out, ref_state = _reference(*parts, ref_state0)
        torch.autograd.backward([ref_out, ref_state], [d_out[:, rows], d_state[i : i + 1]])
        assert torch.allclose(out[:, rows], ref_out, atol=2e-4), f"sequence {i} output"
        assert torch.allclose(state[i : i + 1], ref_state, atol=2e-4), f"sequence {i} state"
        assert torch.allclose(state0.grad[i : i + 1], ref_state0.grad, atol=2e-4, rtol=1e-3)
        for mine, ref in zip((q, k, v, g, beta), parts):
            assert torch.allclose(mine.grad[:, rows], ref.grad, atol=2e-4, rtol=1e-3), f"sequence {i}"


def test_qk_l2norm_in_kernel_backward():
    q, k, v, g, beta = (t.requires_grad_(True) for t in _inputs(1, 7))
    out, _ = gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)
    out.sum().backward()
    parts = [t.detach().clone().requires_grad_(True) for t in (q, k, v, g, beta)]
    qn = torch.nn.functional.normalize(parts[0], dim=-1, eps=1e-6)
    kn = torch.nn.functional.normalize(parts[1], dim=-1, eps=1e-6)
    ref_out, _ = _reference(qn, kn, parts[2], parts[3], parts[4], torch.zeros(1, 2, 16, 16))
    ref_out.sum().backward()
    assert torch.allclose(out, ref_out, atol=2e-4)
    for mine, ref in zip((q, k, v, g, beta), parts):
        assert torch.allclose(mine.grad, ref.grad, atol=2e-4, rtol=1e-3)


def _kernel(q, k, v, g, beta, state):
    return fused_recurrent_gated_delta_rule(q, k, v, g=g, beta=beta, initial_state=state,
                                            output_final_state=True)


def test_prefill_then_decode_equals_one_pass():
    """The engine's state handoff: prefill 11 tokens, then 6 one-token decode steps, each call
    with the state from the last (as the engine keeps it per request) == one pass, bitwise."""
    q, k, v, g, beta = _inputs(1, 17)
    full, full_state = _kernel(q, k, v, g, beta, torch.zeros(1, 2, 16, 16))
    out, state = _kernel(*(t[:, :11] for t in (q, k, v, g, beta)), torch.zeros(1, 2, 16, 16))
    pieces = [out]
    for t in range(11, 17):
        step, state = _kernel(*(x[:, t : t + 1] for x in (q, k, v, g, beta)), state)
        pieces.append(step)
    assert torch.equal(torch.cat(pieces, dim=1), full)
    assert torch.equal(state, full_state)


def test_varlen_equals_batched_and_forward_equals_the_kernel():
    q, k, v, g, beta = _inputs(3, 6)
    batched, _ = gated_delta_rule(q, k, v, g, beta)
    packed, _ = gated_delta_rule(
        *(t.reshape(1, 18, *t.shape[2:]) for t in (q, k, v, g, beta)),
        cu_seqlens=torch.tensor([0, 6, 12, 18]),
    )
    assert torch.equal(packed.reshape(batched.shape), batched)
    direct, _ = _kernel(q, k, v, g, beta, torch.zeros(3, 2, 16, 16))
    assert torch.equal(batched, direct)


def test_bad_arguments():
    q, k, v, g, beta = _inputs(1, 4)
    with pytest.raises(ValueError, match="chunk backend .cuda."):
        gated_delta_rule(q, k, v, g, beta, chunk_backend="cuda")
    with pytest.raises(ValueError, match="forward kernel 'parallel'"):
        gated_delta_rule(q, k, v, g, beta, forward="parallel")
    with pytest.raises(ValueError, match="expand q/k heads"):
        gated_delta_rule(q, k, torch.randn(1, 4, 4, 16), g, beta)


def test_auto_backend_takes_the_torch_rule_for_cpu_tensors():
    q = torch.zeros(1, 4, 2, 8)
    assert gdn_rule.chunk_backward_backend("auto", q) == "torch"
    assert gdn_rule.chunk_backward_backend("fla", q) == "fla"


@pytest.mark.parametrize("fla_allows", [True, False])
def test_the_dqkwg_kernel_stands_in_only_where_fla_refuses_its_backward(monkeypatch, fla_allows):
    import fla.ops.gated_delta_rule.chunk as gated_delta_rule_chunk

    from megatron_rl_bi.models.gdn_dqkwg_triton import chunk_bwd_dqkwg

    flas = gated_delta_rule_chunk.chunk_bwd_dqkwg
    monkeypatch.setattr(gated_delta_rule_chunk, "chunk_bwd_dqkwg", flas)  # restored after the test
    monkeypatch.setattr(gdn_rule.compat, "fla_chunk_backward_works", lambda: fla_allows)
    gdn_rule._fla_chunk_backward_here.cache_clear()
    try:
        gdn_rule._fla_chunk_backward_here()
    finally:
        gdn_rule._fla_chunk_backward_here.cache_clear()
    assert gated_delta_rule_chunk.chunk_bwd_dqkwg is (flas if fla_allows else chunk_bwd_dqkwg)
