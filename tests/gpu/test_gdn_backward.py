"""The GDN rule's chunked backward on the GPU with the 'auto' backend (what layers train with):
fla's chunked backward, whose gated `chunk_bwd_dqkwg` step runs as this package's Triton kernel
where fla 0.6.0 refuses it (Hopper with Triton >= 3.4 and < 3.7.1: models/gdn_dqkwg_triton.py).
Against the fp32 torch rule on packed sequences with initial states: forward bits unchanged,
gradients within the loosest ratio fla's own tests allow bf16 kernels against fp32 references
(0.02, relative L2). The kernel alone against its torch reference (models/gdn_dqkwg.py) on the
arguments a real backward gives it: within the bf16 rounding of its outputs (0.005, relative L2:
the two take the same fp32 products of the same bf16 operands, summed in another order, and round
dq, dk and dw to bf16 once, a relative error of at most 2**-9 each)."""

import pytest
import torch
import torch.nn.functional as F

from megatron_rl_bi import compat
from megatron_rl_bi.models.gdn_rule import gated_delta_rule
from megatron_rl_bi.numerics import relative_l2_error

pytestmark = pytest.mark.gpu

FLA_TEST_RATIO = 0.02
KERNEL_VS_TORCH_STEP = 0.005


def _packed(lengths, heads, key_dim, value_dim, seed):
    """q, k, v, g, beta in the dtypes megatron-core's layer gives them, fp32 initial states."""
    generator = torch.Generator(device="cuda").manual_seed(seed)
    tokens = sum(lengths)

    def rand(*shape):
        return torch.randn(*shape, device="cuda", generator=generator)

    q, k = (F.normalize(rand(1, tokens, heads, key_dim), dim=-1).bfloat16() for _ in range(2))
    v = rand(1, tokens, heads, value_dim).bfloat16()
    g = -0.1 * rand(1, tokens, heads).abs()
    beta = torch.sigmoid(rand(1, tokens, heads)).bfloat16()
    state = 0.1 * rand(len(lengths), heads, key_dim, value_dim)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device="cuda", dtype=torch.int32)
    return [t.requires_grad_(True) for t in (q, k, v, g, beta, state)], cu


def _forward_and_gradients(forward, heads, key_dim):
    """Output, final states and input gradients of the rule with the torch rule's backward and
    with the 'auto' one."""
    results = {}
    for backend in ("torch", "auto"):
        inputs, cu = _packed((4096, 1000, 3096), heads, key_dim, 128, seed=2)
        q, k, v, g, beta, state = inputs
        out, final = gated_delta_rule(q, k, v, g, beta, initial_state=state, output_final_state=True,
                                      cu_seqlens=cu, forward=forward, chunk_backend=backend)
        torch.autograd.backward([out, final], [torch.ones_like(out), torch.ones_like(final)])
        results[backend] = (out.detach(), final.detach(), [t.grad for t in inputs])
    return results


def _check_auto_against_the_torch_rule(results):
    assert torch.equal(results["auto"][0], results["torch"][0]) and torch.equal(results["auto"][1], results["torch"][1])
    for name, got, reference in zip("q k v g beta state".split(), results["auto"][2], results["torch"][2]):
        assert relative_l2_error(got, reference) <= FLA_TEST_RATIO, name


@pytest.mark.parametrize("forward", ["recurrent", "chunk"])  # BI mode's forward kernel, default mode's
@pytest.mark.parametrize("heads, key_dim", [(32, 128), (16, 64)])
def test_auto_backward_keeps_the_forward_bits_and_the_torch_rules_gradients(forward, heads, key_dim):
    _check_auto_against_the_torch_rule(_forward_and_gradients(forward, heads, key_dim))


def _recorded_dqkwg_call(monkeypatch, lengths, heads, key_dim):
    """The arguments fla's chunked backward gives its gated `chunk_bwd_dqkwg`, from one backward."""
    import fla.ops.gated_delta_rule.chunk as gated_delta_rule_chunk

    from megatron_rl_bi.models import gdn_rule

    gdn_rule._fla_chunk_backward_here()  # installs the kernel first where fla refuses its own
    calls, installed = [], gated_delta_rule_chunk.chunk_bwd_dqkwg

    def record(*args, **kwargs):
        calls.append((args, kwargs))
        return installed(*args, **kwargs)

    monkeypatch.setattr(gated_delta_rule_chunk, "chunk_bwd_dqkwg", record)
    inputs, cu = _packed(lengths, heads, key_dim, 128, seed=4)
    out, _ = gated_delta_rule(*inputs[:5], initial_state=inputs[5], cu_seqlens=cu, chunk_backend="auto")
    out.float().sum().backward()
    return calls[0]


@pytest.mark.parametrize("heads, key_dim", [(32, 128), (16, 64)])
def test_the_dqkwg_kernel_gives_its_torch_references_gradients(monkeypatch, heads, key_dim):
    from megatron_rl_bi.models.gdn_dqkwg import chunk_bwd_dqkwg as reference
    from megatron_rl_bi.models.gdn_dqkwg_triton import chunk_bwd_dqkwg as kernel

    args, kwargs = _recorded_dqkwg_call(monkeypatch, (4096, 1000, 3096), heads, key_dim)
    for name, got, want in zip(("dq", "dk", "dw", "dg"), kernel(*args, **kwargs), reference(*args, **kwargs)):
        assert got.shape == want.shape and got.dtype == want.dtype, name
        assert relative_l2_error(got, want) <= KERNEL_VS_TORCH_STEP, name


@pytest.mark.skipif(compat.fla_chunk_backward_works(),
                    reason="fla runs its chunked backward itself here (not Hopper, or Triton >= 3.7.1)")
def test_where_fla_refuses_its_backward_the_kernel_stands_in():
    import fla.ops.gated_delta_rule.chunk as gated_delta_rule_chunk

    from megatron_rl_bi.models.gdn_dqkwg_triton import chunk_bwd_dqkwg

    inputs, cu = _packed((300,), 4, 128, 128, seed=3)
    out, _ = gated_delta_rule(*inputs[:5], initial_state=inputs[5], cu_seqlens=cu, chunk_backend="auto")
    out.sum().backward()
    assert gated_delta_rule_chunk.chunk_bwd_dqkwg is chunk_bwd_dqkwg
