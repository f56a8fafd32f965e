"""The GDN rule's chunked backward where fla 0.6.0 refuses its own (Hopper, Triton >= 3.4 and
< 3.7.1): the check that decides whether fla's backward may train a layer
(models/gdn_rule.fla_backward_checked), and the BI rule with the 'auto' backend against the torch
rule on packed sequences with initial states: forward bits unchanged, gradients within the
check's tolerance (bf16 kernels against the fp32 rule)."""

import pytest
import torch

from megatron_rl_bi import compat
from megatron_rl_bi.models import gdn_rule
from megatron_rl_bi.models.gdn_rule import CHECK_ERROR_RATIO, fla_backward_checked, gated_delta_rule
from megatron_rl_bi.numerics import relative_l2_error

pytestmark = pytest.mark.gpu

DTYPES = (torch.bfloat16, torch.float32, torch.bfloat16)  # q/k/v, g, beta as megatron-core's layer gives them
GUARDED = pytest.mark.skipif(compat.fla_chunk_backward_works(),
                             reason="fla runs its chunked backward itself here (not Hopper, or Triton >= 3.7.1)")


@GUARDED
def test_keys_of_128_keep_flas_backward():
    """fla issue 640's miscompile was found at key tiles of 64; fla tiles keys of 128 whole on Hopper."""
    assert fla_backward_checked(32, 128, 128, DTYPES)


@GUARDED
def test_the_check_catches_the_miscompile_at_key_tiles_of_64():
    assert not fla_backward_checked(32, 64, 64, DTYPES)


def _packed(lengths, heads, key_dim, value_dim, seed):
    inputs, cu = gdn_rule._check_inputs(heads, key_dim, value_dim, DTYPES, lengths)
    generator = torch.Generator(device="cuda").manual_seed(seed)
    inputs[-1] = 0.1 * torch.randn(inputs[-1].shape, device="cuda", generator=generator)  # initial states
    return [t.requires_grad_(True) for t in inputs], cu


@pytest.mark.parametrize("heads, key_dim", [(32, 128), (16, 64)])
def test_auto_backward_keeps_the_forward_bits_and_the_torch_rules_gradients(heads, key_dim):
    results = {}
    for backend in ("torch", "auto"):
        inputs, cu = _packed((4096, 1000, 3096), heads, key_dim, 128, seed=2)
        q, k, v, g, beta, state = inputs
        out, final = gated_delta_rule(q, k, v, g, beta, initial_state=state, output_final_state=True,
                                      cu_seqlens=cu, chunk_backend=backend)
        torch.autograd.backward([out, final], [torch.ones_like(out), torch.ones_like(final)])
        results[backend] = (out.detach(), final.detach(), [t.grad for t in inputs])
    assert torch.equal(results["auto"][0], results["torch"][0]) and torch.equal(results["auto"][1], results["torch"][1])
    for name, got, reference in zip("q k v g beta state".split(), results["auto"][2], results["torch"][2]):
        assert relative_l2_error(got, reference) <= CHECK_ERROR_RATIO, name
