"""compat.fa4_hopper_without_split_kv: on SM90 the engine's request for flash-attn-4's split-KV
heuristic (num_splits=0) becomes num_splits=1; elsewhere, and for explicit values, the call is
passed through unchanged."""

import pytest
import torch
from megatron.core.transformer import attention

from megatron_rl_bi import compat


@pytest.fixture
def fa4_calls(monkeypatch):
    calls = []
    monkeypatch.setattr(attention, "flash_attn4_varlen_func",
                        lambda q, *args, **kwargs: calls.append(kwargs.get("num_splits")), raising=False)
    compat.fa4_hopper_without_split_kv()
    compat.fa4_hopper_without_split_kv()  # idempotent: one wrapper
    return calls


@pytest.mark.parametrize("capability,asked,passed", [
    ((9, 0), 0, 1), ((9, 0), 1, 1), ((9, 0), 3, 3), ((10, 0), 0, 0), ((12, 0), 0, 0)])
def test_split_kv_heuristic_is_off_only_on_hopper(fa4_calls, monkeypatch, capability, asked, passed):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    attention.flash_attn4_varlen_func(torch.zeros(1), num_splits=asked)
    assert fa4_calls == [passed]


def test_a_call_without_num_splits_is_unchanged(fa4_calls, monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    attention.flash_attn4_varlen_func(torch.zeros(1))
    assert fa4_calls == [None]
