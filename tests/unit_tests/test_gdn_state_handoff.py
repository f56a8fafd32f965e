"""The engine's GDN schedule on CPU (fla's Triton kernels in the interpreter): sequences cut into
a prefill and one-token decode steps, mixed with other requests in varlen batches, each call
starting from the states the last one left (as `SwitchedGatedDeltaNet._engine_forward` keeps them
per request), give the bits of one pass over each sequence alone, for the short convolution and
the recurrent rule together."""

import pytest
import torch
from fla.modules.convolution import causal_conv1d

from megatron_rl_bi.models.gdn_rule import gated_delta_rule

HEADS, DIM, WIDTH = 2, 8, 4
CHANNELS = 3 * HEADS * DIM  # q, k, v


@pytest.fixture(autouse=True)
def _autotune_on_cpu(single_config_autotune):
    pass


def _layer(x, g, beta, cu_seqlens, conv_state, rule_state, weight):
    """conv -> split heads -> recurrent rule, the kernel calls of `_varlen_core`."""
    mixed, conv_final = causal_conv1d(x=x, weight=weight, activation="silu",
                                      initial_state=conv_state, output_final_state=True,
                                      cu_seqlens=cu_seqlens)
    q, k, v = (t.reshape(1, x.shape[1], HEADS, DIM) for t in mixed.split(HEADS * DIM, dim=-1))
    out, rule_final = gated_delta_rule(q, k, v, g, beta, initial_state=rule_state,
                                       output_final_state=True, use_qk_l2norm_in_kernel=True,
                                       cu_seqlens=cu_seqlens)
    return out, conv_final, rule_final


def _sequence(length, gen):
    x = torch.randn(1, length, CHANNELS, generator=gen)
    g = -torch.rand(1, length, HEADS, generator=gen) * 0.5
    beta = torch.rand(1, length, HEADS, generator=gen)
    return x, g, beta


def _zeros(n):
    return torch.zeros(n, CHANNELS, WIDTH), torch.zeros(n, HEADS, DIM, DIM)


def test_prefill_and_mixed_decode_steps_equal_one_pass_per_sequence():
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(CHANNELS, WIDTH, generator=gen)
    seq_a, seq_b = _sequence(13, gen), _sequence(9, gen)

    def alone(seq):
        return _layer(*seq, torch.tensor([0, seq[0].shape[1]]), *_zeros(1), weight)

    def rows(seq, start, end):
        return [t[:, start:end] for t in seq]

    # Engine steps: prefill A[:8]; then decode A[8] together with B's whole prefill (decode
    # requests first, as the engine orders them); then decode A[9..12] alone.
    out_a, conv_a, rule_a = _layer(*rows(seq_a, 0, 8), torch.tensor([0, 8]), *_zeros(1), weight)
    pieces_a = [out_a]
    step = [torch.cat(parts, dim=1) for parts in zip(rows(seq_a, 8, 9), rows(seq_b, 0, 9))]
    conv_b, rule_b = _zeros(1)
    out, conv, rule = _layer(*step, torch.tensor([0, 1, 10]), torch.cat([conv_a, conv_b]),
                             torch.cat([rule_a, rule_b]), weight)
    pieces_a.append(out[:, :1])
    out_b, (conv_a, conv_b), (rule_a, rule_b) = out[:, 1:], conv.split(1), rule.split(1)
    for t in range(9, 13):
        out, conv_a, rule_a = _layer(*rows(seq_a, t, t + 1), torch.tensor([0, 1]), conv_a,
                                     rule_a, weight)
        pieces_a.append(out)

    full_a, full_conv_a, full_rule_a = alone(seq_a)
    full_b, full_conv_b, full_rule_b = alone(seq_b)
    assert torch.equal(torch.cat(pieces_a, dim=1), full_a)
    assert torch.equal(out_b, full_b)
    assert torch.equal(conv_a, full_conv_a) and torch.equal(rule_a, full_rule_a)
    assert torch.equal(conv_b, full_conv_b) and torch.equal(rule_b, full_rule_b)
