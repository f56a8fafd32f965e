"""Hybrid GDN model on the GPU. BI mode: a GDN layer's rows and a packed batch's sequences get
the same bits as alone; engine logprobs == trainer logprobs before and after an optimizer step.
Default mode: the chunked forward trains (fla's own backward or the torch one) and the harness
sees a mismatch."""

import pytest
import torch

from megatron_rl_bi import bi
from megatron_rl_bi.inference import EngineConfig, Generator, Sampling
from megatron_rl_bi.parity.harness import random_requests, run_parity

from .conftest import TINY_HYBRID_ARGS, VOCAB_SIZE, assert_parity_across_a_step, build, packed_logits

pytestmark = pytest.mark.gpu

ENGINE = EngineConfig(max_requests=64, max_tokens=8192, max_sequence_length=1024,
                      buffer_size_gb=4.0, prompt_logprobs=True)


def _build(batch_invariant: bool):
    return build(TINY_HYBRID_ARGS, batch_invariant, seed=0)


@pytest.fixture(scope="module")
def hybrid(distributed):
    yield _build(batch_invariant=True)
    bi.disable()


def _first_gdn(model):
    return next(m for m in model.modules() if type(m).__name__ == "SwitchedGatedDeltaNet")


def test_gdn_layer_rows_batched_packed_alone(hybrid):
    """[s, b, h] batch of N == each b alone (B = 1) == the N sequences packed (THD)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    gdn = _first_gdn(hybrid)
    torch.manual_seed(1)
    seq_len, batch = 97, 5
    hidden = torch.randn(seq_len, batch, gdn.hidden_size, device="cuda", dtype=torch.bfloat16)
    cu = torch.arange(0, (batch + 1) * seq_len, seq_len, dtype=torch.int32, device="cuda")
    packed_params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                                    max_seqlen_q=seq_len, max_seqlen_kv=seq_len)
    with torch.no_grad():
        batched = gdn(hidden, None)[0]
        alone = torch.cat([gdn(hidden[:, b : b + 1], None)[0] for b in range(batch)], dim=1)
        packed = gdn(hidden.transpose(0, 1).reshape(-1, 1, gdn.hidden_size), None,
                     packed_seq_params=packed_params)[0]
    assert torch.equal(batched, alone)
    assert torch.equal(packed.reshape(batch, seq_len, -1).transpose(0, 1), batched)


def test_packed_equals_alone(hybrid):
    torch.manual_seed(0)
    sequences = [torch.randint(0, VOCAB_SIZE, (n,)).tolist() for n in (1, 77, 300, 5, 129)]
    hybrid.train()
    with torch.no_grad():
        packed = packed_logits(hybrid, sequences)
        alone = torch.cat([packed_logits(hybrid, [s]) for s in sequences])
    assert torch.equal(packed, alone)


def _check_backward(model):
    sequences = [torch.randint(0, VOCAB_SIZE, (n,)).tolist() for n in (40, 90)]
    model.train()
    model.zero_grad()
    packed_logits(model, sequences).float().logsumexp(-1).mean().backward()
    grads = [p.grad for n, p in model.named_parameters() if "A_log" in n or "in_proj" in n]
    assert grads and all(g is not None and torch.isfinite(g).all() and g.abs().sum() > 0
                         for g in grads)


def test_backward_runs(hybrid):
    _check_backward(hybrid)


def test_engine_matches_trainer_bitwise_before_and_after_a_step(hybrid):
    """The same Generator (same module) before and after an optimizer step on the weights."""
    assert_parity_across_a_step(hybrid, ENGINE, lambda: _check_backward(hybrid))


def test_default_mode_trains_and_sees_a_mismatch(hybrid):
    with bi.batch_invariant(False):  # restored after: later tests use the BI model
        model = _build(batch_invariant=False)
        model.load_state_dict(hybrid.state_dict())
        _check_backward(model)
        prompts, budgets = random_requests(32, (1, 500), (1, 256), VOCAB_SIZE, seed=11)
        result = run_parity(model, Generator(model, ENGINE), prompts, budgets,
                            Sampling(temperature=1.0, seed=11), micro_batch_tokens=6000, orders=1)
    assert result["all_reported"]["bit_wise/logprob_diff/abs_mean"] > 0
