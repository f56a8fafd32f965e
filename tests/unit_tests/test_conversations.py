"""Multi-turn rollouts on CPU with a scripted engine and environment: which tokens were sampled
and which the environment wrote (hand-written), stop strings, the turn and context limits, an
environment that fails, times out or answers malformed (its sample scores 0, counted, the
others go on), --rl-env loading, and the step's conversation metrics."""

import time
from types import SimpleNamespace

import pytest

from megatron_rl_bi.envs import Example, PromptSource
from megatron_rl_bi.envs.environment import FAILED, TIMED_OUT, call_all, load_environment
from megatron_rl_bi.envs.tokenizer import CharTokenizer
from megatron_rl_bi.inference import Generation, Sampling
from megatron_rl_bi.rl.conversations import TurnConfig, run_conversations, tokens_through_stop
from megatron_rl_bi.rl.rollouts import RolloutConfig, collect_rollouts

from .conftest import ScriptedGenerator

TOK = CharTokenizer()
SAMPLING = Sampling(max_new_tokens=16, eod_id=TOK.eod, seed=0)


class KeyValue:
    """Look the key up with <s>KEY</s>; answer with <a>VALUE</a> (reward 1 when right)."""

    stop_strings = ("</s>",)

    def reset(self, example):
        self.answer = example.answer
        return example.prompt

    def step(self, text):
        if text.endswith("</s>"):
            return f"={self.answer};", 0.0, False
        return "", float(text == f"<a>{self.answer}</a>"), True


class ScriptedEngine(ScriptedGenerator):
    """Turn k of a conversation (k = the </s> in its text so far) samples turns[k]; '$' is the
    end-of-document token. Each turn's logprobs are -0.5 (first turn), -0.25 (second), ..."""

    def __init__(self, turns, max_sequence_length=64):
        self.turns, self.requests = turns, []
        self.config = SimpleNamespace(max_sequence_length=max_sequence_length,
                                      max_prompt_tokens=max_sequence_length - 1)

    def generate(self, prompts, sampling, max_new_tokens=None):
        out = []
        for prompt, budget in zip(prompts, max_new_tokens):
            self.requests.append((TOK.decode(prompt), budget))
            k = TOK.decode(prompt).count("</s>")
            text = self.turns[k]
            ids = (TOK.encode(text.rstrip("$")) + ([TOK.eod] if text.endswith("$") else []))[:budget]
            out.append(Generation(prompt_tokens=list(prompt), completion_tokens=ids,
                                  completion_logprobs=[-0.5 / 2**k] * len(ids),
                                  stopped_on_eod=ids[-1:] == [TOK.eod]))
        return out


EXAMPLE = Example(prompt="find k\n", answer="v", verify=None)


class Untidy(KeyValue):
    """Answers a search with a tab and characters the char tokenizer lacks, as a shell's output can."""

    def step(self, text):
        if text.endswith("</s>"):
            return "a\tb\ufffd\u00e9;", 0.0, False
        return super().step(text)


def test_an_answer_outside_the_char_vocabulary_reads_as_question_marks_not_a_failure():
    assert TOK.encode_observation("a\tb\u00e9\n") == TOK.encode("a?b?\n")
    with pytest.raises(ValueError, match="outside the char tokenizer's vocabulary"):
        TOK.encode("a\tb")  # prompts and datasets stay checked
    engine = ScriptedEngine(["<s>k</s>", "<a>v</a>$"])
    [conversation], [score], counts = run_conversations(engine, [EXAMPLE], Untidy, TOK, SAMPLING,
                                                          TurnConfig(max_turns=3))
    assert TOK.decode(conversation.completion_tokens) == "<s>k</s>a?b??;<a>v</a>" and score == (1.0, None)


def test_a_conversation_keeps_who_wrote_each_token():
    engine = ScriptedEngine(["<s>k</s>yy", "<a>v</a>$"])
    [conversation], [score], counts = run_conversations(engine, [EXAMPLE], KeyValue, TOK, SAMPLING,
                                                          TurnConfig(max_turns=3))
    assert conversation.prompt_tokens == TOK.encode("find k\n")
    # turn 1 kept through its stop string ("yy" after it dropped), the environment's "=v;", turn 2
    assert TOK.decode(conversation.completion_tokens) == "<s>k</s>=v;<a>v</a>"
    assert conversation.completion_tokens[-1] == TOK.eod and conversation.stopped_on_eod
    assert conversation.completion_sampled == [True] * 8 + [False] * 3 + [True] * 9
    assert conversation.completion_logprobs == [-0.5] * 8 + [0.0] * 3 + [-0.25] * 9
    assert conversation.sampled_tokens == 17
    assert score == (1.0, None)
    assert (counts["turns"], counts["turns_max"], counts["truncated"]) == (2, 2, 0)
    # the second turn continued the same tokens: prompt, turn 1 and the environment's answer
    assert engine.requests[1][0] == "find k\n<s>k</s>=v;"


def test_an_environment_answer_is_cut_to_its_token_budget():
    engine = ScriptedEngine(["<s>k</s>", "<a>v</a>$"])
    [conversation], _, _ = run_conversations(engine, [EXAMPLE], KeyValue, TOK, SAMPLING,
                                             TurnConfig(max_turns=3, observation_tokens=2))
    # the environment answered "=v;": its first 2 tokens join the conversation
    assert TOK.decode(conversation.completion_tokens) == "<s>k</s>=v<a>v</a>"
    assert conversation.completion_sampled == [True] * 8 + [False] * 2 + [True] * 9


def test_stop_strings_cut_a_turn_after_the_token_that_completes_them():
    ids = TOK.encode("ab</s>cd")
    assert tokens_through_stop(ids, TOK, ("</s>",)) == 6
    assert tokens_through_stop(ids, TOK, ("</x>",)) == 8
    assert tokens_through_stop(ids, TOK, ("cd", "b<")) == 3  # the first stop string completed
    long = TOK.encode("x" * 300 + "</s>" + "y" * 200)
    for k in range(1, 8):  # every position, found by bisection
        assert tokens_through_stop(long[:300] + TOK.encode("</s>")[:k], TOK, ("</s>",)) == (304 if k >= 4 else 300 + k)
    assert tokens_through_stop(long, TOK, ("</s>",)) == 304


def test_turn_and_context_limits_cut_a_conversation():
    engine = ScriptedEngine(["<s>k</s>", "<s>k</s>", "<s>k</s>"])
    _, [score], counts = run_conversations(engine, [EXAMPLE], KeyValue, TOK, SAMPLING, TurnConfig(max_turns=2))
    assert score == (0.0, None) and (counts["turns"], counts["truncated"]) == (2, 1)
    # 7 prompt tokens in a context of 20: turn 1 may sample 13, turn 2 the 2 left after "<s>k</s>=v;"
    engine = ScriptedEngine(["<s>k</s>", "<s>kkkkk</s>"])
    [conversation], _, _ = run_conversations(engine, [EXAMPLE], KeyValue, TOK, SAMPLING,
                                             TurnConfig(max_turns=4, max_context_tokens=20))
    assert [budget for _, budget in engine.requests] == [13, 2]
    assert len(conversation.tokens) == 20


class Finishing(KeyValue):
    """Scores a conversation the limits cut as a terminal's tests do: by the state it left."""

    def finish(self):
        return 0.5


def test_a_conversation_the_turn_limit_cuts_is_scored_by_finish_and_counted_cut():
    engine = ScriptedEngine(["<s>k</s>", "<s>k</s>", "<s>k</s>"])
    _, [score], counts = run_conversations(engine, [EXAMPLE], Finishing, TOK, SAMPLING, TurnConfig(max_turns=2))
    assert score == (0.5, None) and (counts["turns"], counts["truncated"]) == (2, 1)
    engine = ScriptedEngine(["<a>v</a>$"])  # over by its own answer: finish is not called
    _, [score], _ = run_conversations(engine, [EXAMPLE], Finishing, TOK, SAMPLING, TurnConfig(max_turns=2))
    assert score == (1.0, None)


class Broken(KeyValue):
    def __init__(self):
        if Broken.builds_left == 0:
            raise RuntimeError("environment constructor crashed")
        Broken.builds_left -= 1

    def step(self, text):
        if self.answer == "bad":
            raise RuntimeError("tool crashed")
        if self.answer == "slow":
            time.sleep(5)
        if self.answer == "nan":
            return "", float("nan"), True
        return super().step(text)


def test_failing_hanging_or_malformed_environments_score_0_and_are_counted():
    examples = [Example(prompt="find k\n", answer=a, verify=None) for a in ("bad", "slow", "nan", "v", "v")]
    engine = ScriptedEngine(["<a>v</a>$"])
    Broken.builds_left = 4  # the fifth sample's environment fails to build
    started = time.monotonic()
    generations, scores, counts = run_conversations(engine, examples, Broken, TOK, SAMPLING,
                                                    TurnConfig(env_timeout_s=0.5))
    assert time.monotonic() - started < 3  # the hung call was not waited for
    assert scores == [(0.0, FAILED), (0.0, TIMED_OUT), (0.0, FAILED), (1.0, None), (0.0, FAILED)]
    assert (counts[FAILED], counts[TIMED_OUT]) == (3, 1)
    assert generations[4].prompt_tokens == TOK.encode("find k\n") and generations[4].completion_tokens == []
    assert 0.5 <= counts["env_seconds"] < 3  # the turn waited for its slowest call, up to the limit


def test_calls_run_together_within_one_deadline():
    started = time.monotonic()
    outcomes = call_all([lambda: time.sleep(0.3) or 1] * 8, timeout_s=2.0)
    assert [o.value for o in outcomes] == [1] * 8 and time.monotonic() - started < 1.5


@pytest.mark.parametrize("spec,message", [
    ("tests.unit_tests.test_conversations:KeyValue", None),
    ("tests.unit_tests.test_conversations:EXAMPLE", "expected a class with reset"),
    ("tests.unit_tests.test_conversations:ScriptedEngine", "it lacks reset, step, stop_strings"),
    ("no_such_module_abc:Env", "cannot load no_such_module_abc"),
])
def test_rl_env_loads_a_class_with_the_interface_or_names_the_flag(spec, message):
    if message is None:
        assert load_environment(spec) is KeyValue
        return
    with pytest.raises(ValueError, match=f"--rl-env {spec}: .*{message}"):
        load_environment(spec)


class KeyTask:
    size = None

    def example(self, index):
        return Example(prompt="find k\n", answer="v", verify=None)


def test_a_step_of_conversations_reports_turns_and_whose_tokens():
    engine = ScriptedEngine(["<s>k</s>", "<a>v</a>$"])
    config = RolloutConfig(prompts_per_step=1, group_size=2, environment=KeyValue, turns=TurnConfig(max_turns=3))
    groups, terms = collect_rollouts(engine, PromptSource(KeyTask(), 0), TOK, SAMPLING, config, weight_version=0)
    metrics = terms.finalize()
    assert [r.reward for r in groups[0]] == [1.0, 1.0]
    assert metrics["rollouts/turns"] == 2 and metrics["rollouts/turns_max"] == 2
    assert metrics["rollouts/sampled_tokens"] == 17 and metrics["rollouts/environment_tokens"] == 3
    assert metrics["rollouts/env_failures"] == 0 and metrics["rollouts/env_timeouts"] == 0
