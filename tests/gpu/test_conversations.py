"""Multi-turn rollouts on the GPU (BI mode, dense and hybrid): every sampled token of a
three-turn conversation, environment tokens between the turns, has the trainer's logprob bit
for bit; and when the weights change between turns, each turn's tokens have the logprobs of the
weights that sampled them (the engine computes a conversation's context again under the current
weights at every turn, so no turn continues from another version's KV cache). With prefix
caching (dense), later turns reuse the blocks earlier turns prefilled, and no bit changes."""

import dataclasses
import random

import pytest
import torch

from megatron_rl_bi import bi
from megatron_rl_bi.envs import Example
from megatron_rl_bi.inference import EngineConfig, Generator, Sampling
from megatron_rl_bi.parity.harness import trainer_vs_engine
from megatron_rl_bi.rl.conversations import TurnConfig, run_conversations

from .conftest import TINY_DENSE_ARGS, TINY_HYBRID_ARGS, VOCAB_SIZE, build

pytestmark = pytest.mark.gpu

MODELS = {"dense": TINY_DENSE_ARGS, "hybrid": TINY_HYBRID_ARGS}
TURN_TOKENS, TURNS, OBSERVATION = 16, 3, "11 12 13"
ENGINE = EngineConfig(max_requests=32, max_tokens=8192, max_sequence_length=1024, buffer_size_gb=2.0)


class NumberTokenizer:
    """Token ids written as decimal words: every id list survives decode and encode."""

    eod = None

    def encode(self, text):
        return [int(word) for word in text.split()]

    encode_prompt = encode_observation = encode

    def decode(self, ids):
        return " ".join(map(str, ids))


class ThreeTurns:
    """Answers every turn with the same three tokens; over after the third."""

    stop_strings = ()

    def reset(self, example):
        self.turns = 0
        return example.prompt

    def step(self, text):
        self.turns += 1
        return OBSERVATION, 0.0, self.turns >= TURNS


class ChangingWeights:
    """The engine, with the model's weights moved in place after the first `turns` turns."""

    def __init__(self, generator, model, turns):
        self.generator, self.model, self.turns, self.calls = generator, model, turns, 0
        self.config, self.before = generator.config, None

    def generate(self, prompts, sampling, max_new_tokens=None):
        if self.calls == self.turns:
            self.before = [parameter.detach().clone() for parameter in self.model.parameters()]
            with torch.no_grad():
                for parameter in self.model.parameters():
                    parameter.add_(torch.randn_like(parameter), alpha=1e-2)
        self.calls += 1
        return self.generator.generate(prompts, sampling, max_new_tokens)

    def conversation(self):
        return self.generator.conversation()


@pytest.fixture(params=sorted(MODELS))
def model(request, distributed):
    try:
        yield build(MODELS[request.param], batch_invariant=True)
    finally:
        bi.disable()


def _conversations(engine):
    rng = random.Random(0)
    examples = [Example(prompt=" ".join(str(rng.randrange(VOCAB_SIZE)) for _ in range(rng.randint(5, 200))),
                        answer="", verify=None) for _ in range(8)]
    generations, _, counts = run_conversations(engine, examples, ThreeTurns, NumberTokenizer(),
                                               Sampling(max_new_tokens=TURN_TOKENS, seed=3),
                                               TurnConfig(max_turns=TURNS))
    assert counts["turns"] == TURNS * len(examples)
    return generations


def _sampled_equal(model, generations, positions) -> bool:
    """Trainer vs engine logprobs, torch.equal, at the packed positions `positions` selects
    from the reported (sampled) ones."""
    compared = trainer_vs_engine(model, generations, micro_batch_tokens=6000)
    chosen = compared["reported"] & positions(compared)
    return bool(chosen.any()) and torch.equal(compared["train"][chosen], compared["engine"][chosen])


def test_every_sampled_token_of_every_turn_has_the_trainers_logprob(model):
    generations = _conversations(Generator(model, ENGINE))
    compared = trainer_vs_engine(model, generations, micro_batch_tokens=6000)
    reported = compared["reported"]
    assert reported.sum().item() == len(generations) * TURNS * TURN_TOKENS  # environment tokens left out
    assert torch.equal(compared["train"][reported], compared["engine"][reported])


def test_a_turn_after_the_weights_change_is_computed_under_the_new_weights(model):
    engine = ChangingWeights(Generator(model, ENGINE), model, turns=2)
    generations = _conversations(engine)
    # per conversation: prompt, turn 1, observation, turn 2, observation, turn 3
    last_turn = torch.cat([torch.cat([torch.zeros(len(g.tokens) - 1 - TURN_TOKENS, dtype=torch.bool),
                                      torch.ones(TURN_TOKENS, dtype=torch.bool), torch.zeros(1, dtype=torch.bool)])
                           for g in generations])
    assert _sampled_equal(model, generations, lambda c: last_turn)  # the new weights
    with torch.no_grad():
        for parameter, before in zip(model.parameters(), engine.before):
            parameter.copy_(before)
    assert _sampled_equal(model, generations, lambda c: ~last_turn)  # turns 1 and 2: the old weights


def test_prefix_caching_reuses_earlier_turns_and_changes_no_bit(distributed):
    try:
        model = build(TINY_DENSE_ARGS, batch_invariant=True)
        small_blocks = dataclasses.replace(ENGINE, block_size_tokens=64)  # conversations span whole blocks
        plain = _conversations(Generator(model, small_blocks))
        cached_engine = Generator(model, dataclasses.replace(small_blocks, prefix_caching=True))
        cached = _conversations(cached_engine)
    finally:
        bi.disable()
    assert [(g.tokens, g.completion_logprobs) for g in cached] == [(g.tokens, g.completion_logprobs) for g in plain]
    assert cached_engine.engine._prefill_tokens_skipped > 0  # megatron-core's own count: blocks were reused


def test_prefix_caching_is_refused_for_hybrid_models(distributed):
    try:
        model = build(TINY_HYBRID_ARGS, batch_invariant=True)
        with pytest.raises(ValueError, match="--inference-dynamic-batching-prefix-caching: not with hybrid GDN"):
            Generator(model, dataclasses.replace(ENGINE, prefix_caching=True))
    finally:
        bi.disable()
