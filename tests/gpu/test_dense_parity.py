"""Dense GPT: trainer batch invariance and engine-vs-trainer logprob parity on the GPU."""

import dataclasses

import pytest
import torch

from megatron_rl_bi import bi
from megatron_rl_bi.inference import EngineConfig, Generator, Sampling
from megatron_rl_bi.packing import pack_sequences
from megatron_rl_bi.parity.harness import random_requests, run_parity

from .conftest import VOCAB_SIZE, build_dense

pytestmark = pytest.mark.gpu

ENGINE = EngineConfig(max_requests=64, max_tokens=8192, max_sequence_length=1024,
                      buffer_size_gb=2.0, prompt_logprobs=True)


@pytest.fixture(scope="module")
def bi_model(distributed):
    model = build_dense(batch_invariant=True)
    yield model
    bi.disable()


def test_forward_is_batch_invariant(bi_model):
    """Logits of a packed batch == the logits of its splits, concatenated."""
    torch.manual_seed(0)
    sequences = [torch.randint(0, VOCAB_SIZE, (n,)).tolist() for n in (1, 300, 45, 500, 17, 128)]
    bi_model.train()

    def logits_of(seqs):
        batch = pack_sequences(seqs).to("cuda")
        with torch.no_grad():
            return bi_model(input_ids=batch.input_ids, position_ids=batch.position_ids,
                            attention_mask=None, packed_seq_params=batch.packed_seq_params())[0]

    full = logits_of(sequences)
    split = torch.cat([logits_of(sequences[:2]), logits_of(sequences[2:3]), logits_of(sequences[3:])])
    assert torch.equal(full, split)


def test_engine_matches_trainer_bitwise_in_bi_mode(bi_model):
    prompts, budgets = random_requests(32, (1, 500), (1, 256), VOCAB_SIZE, seed=7)
    result = run_parity(bi_model, Generator(bi_model, ENGINE), prompts, budgets,
                        Sampling(temperature=1.0, seed=7), micro_batch_tokens=6000, orders=2)
    metrics = result["all_reported"]
    assert metrics["bit_wise/tokens"] >= 5000
    assert result["completion_only"]["bit_wise/tokens"] >= 2 * 256
    assert metrics["bit_wise/ratio_tokens_different"] == 0.0, metrics
    assert metrics["bit_wise/logprob_diff/max"] == 0.0, metrics


def test_default_mode_harness_sees_a_mismatch(bi_model, distributed):
    with bi.batch_invariant(False):  # restored after: later tests use the BI model
        model = build_dense(batch_invariant=False)
        model.load_state_dict(bi_model.state_dict())
        prompts, budgets = random_requests(32, (1, 500), (1, 256), VOCAB_SIZE, seed=7)
        result = run_parity(model, Generator(model, ENGINE), prompts, budgets,
                            Sampling(temperature=1.0, seed=7), micro_batch_tokens=6000, orders=1)
    assert result["all_reported"]["bit_wise/logprob_diff/abs_mean"] > 0


def _assert_parity_with(model, engine: EngineConfig, requests: int, temperature: float, seed: int):
    """Parity 0 over `requests` short requests with an engine configured otherwise than ENGINE."""
    prompts, budgets = random_requests(requests, (1, 300), (1, 128), VOCAB_SIZE, seed=seed)
    result = run_parity(model, Generator(model, engine), prompts, budgets,
                        Sampling(temperature=temperature, seed=seed), micro_batch_tokens=6000, orders=1)
    assert result["completion_only"]["bit_wise/tokens"] >= 128
    assert result["all_reported"]["bit_wise/logprob_diff/max"] == 0.0, result["all_reported"]


def test_async_scheduling_keeps_parity(bi_model):
    """megatron-core's async scheduling changes which steps run which requests, not the bits."""
    _assert_parity_with(bi_model, dataclasses.replace(ENGINE, async_scheduling=True), 24, 1.0, seed=11)


def test_temperature_parity(bi_model):
    """At temperature 0.7 the engine reports processed logprobs and the trainer divides its logits
    the same way: still bitwise equal."""
    _assert_parity_with(bi_model, dataclasses.replace(ENGINE, processed_logprobs=True), 16, 0.7, seed=9)
