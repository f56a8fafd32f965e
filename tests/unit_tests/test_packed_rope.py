"""compat.one_call_packed_rope: rope on packed (THD) sequences in one call gives megatron-core's
per-sequence bits, forward and backward (torch.equal), full and partial rotary, both rotate-half
layouts; with context parallelism or packed frequencies it is upstream's code."""

import pytest
import torch
from megatron.core.models.common.embeddings import rope_utils

from megatron_rl_bi import compat

UPSTREAM = rope_utils._apply_rotary_pos_emb_thd


class OneRank:
    def size(self):
        return 1

    def rank(self):
        return 0


@pytest.fixture
def one_call(monkeypatch):
    monkeypatch.setattr(rope_utils, "_apply_rotary_pos_emb_thd", UPSTREAM)
    compat.one_call_packed_rope()
    compat.one_call_packed_rope()  # idempotent
    assert rope_utils._apply_rotary_pos_emb_thd.one_call
    return rope_utils._apply_rotary_pos_emb_thd


def _rope_and_grad(fn, t, cu_seqlens, freqs, **kwargs):
    t = t.detach().clone().requires_grad_(True)
    out = fn(t, cu_seqlens, freqs, cp_group=OneRank(), **kwargs)
    out.backward(torch.arange(out.numel(), dtype=out.dtype).reshape(out.shape).sin())
    return out.detach(), t.grad


@pytest.mark.parametrize("rotary_dim", [32, 8])  # full and partial rotary
@pytest.mark.parametrize("interleaved", [False, True])
def test_one_call_equals_per_sequence(one_call, rotary_dim, interleaved):
    torch.manual_seed(0)
    lengths = [5, 1, 17, 9]
    cu_seqlens = torch.tensor([0, 5, 6, 23, 32], dtype=torch.int32)
    t = torch.randn(sum(lengths), 4, 32).bfloat16()
    inv = 1.0 / (10000 ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim))
    freqs = torch.outer(torch.arange(64).float(), inv)
    freqs = torch.cat([freqs, freqs], dim=-1)[:, None, None, :]  # [max_s, 1, 1, rotary_dim]
    kwargs = dict(rotary_interleaved=interleaved, mscale=1.25)
    ours, ours_grad = _rope_and_grad(one_call, t, cu_seqlens, freqs, **kwargs)
    theirs, theirs_grad = _rope_and_grad(UPSTREAM, t, cu_seqlens, freqs, **kwargs)
    assert torch.equal(ours, theirs) and torch.equal(ours_grad, theirs_grad)
    assert not torch.equal(ours, t)


def test_context_parallel_and_packed_frequencies_go_upstream(monkeypatch):
    calls = []
    monkeypatch.setattr(rope_utils, "_apply_rotary_pos_emb_thd",
                        lambda t, *args: calls.append(args[-2].size()) or t)
    compat.one_call_packed_rope()  # wraps the spy as upstream

    class TwoRanks(OneRank):
        def size(self):
            return 2

    t, cu_seqlens = torch.zeros(4, 1, 8), torch.tensor([0, 4], dtype=torch.int32)
    one_call = rope_utils._apply_rotary_pos_emb_thd
    one_call(t, cu_seqlens, torch.zeros(64, 1, 1, 8), cp_group=TwoRanks())  # context parallel
    one_call(t, cu_seqlens, torch.zeros(4, 1, 1, 8), cp_group=OneRank())  # per-token frequencies
    one_call(t, cu_seqlens, torch.zeros(64, 1, 1, 8), cp_group=OneRank())  # ours
    assert calls == [2, 1]
