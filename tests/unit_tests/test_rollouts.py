"""Rollout collection (rewards, overlong shaping, dynamic-sampling refill, advantages) and their
packing for the trainer, on CPU with a scripted stand-in for the engine."""

import pytest
import torch

from megatron_rl_bi.envs import Example, PromptSource
from megatron_rl_bi.envs.tokenizer import CharTokenizer
from megatron_rl_bi.inference import Generation, Sampling
from megatron_rl_bi.rl.rollouts import Rollout, RolloutConfig, collect_rollouts

TOK = CharTokenizer()


class ScriptedTask:
    """Prompt i is 'p<i>\\n'; the answer is 'ok'; example 2's verifier crashes; 'nan' scores NaN."""

    size = None

    def example(self, index):
        def verify(completion, index=index):
            if index == 2:
                raise RuntimeError("verifier bug")
            return float("nan") if completion == "nan" else float(completion == "ok")

        return Example(prompt=f"p{index}\n", answer="ok", verify=verify)


class ScriptedGenerator:
    """Answers prompt i with completions[i] (texts; '$' marks end-of-document)."""

    def __init__(self, completions, budget=None):
        """`budget`: the clamped budget the engine reports per request (default: the asked one)."""
        self.completions, self.calls, self.budget = completions, [], budget

    def generate(self, prompts, sampling, max_new_tokens=None):
        self.calls.append((len(prompts), sampling.seed))
        counters, out = {}, []
        for prompt in prompts:
            index = int(TOK.decode(prompt)[1:-1])
            k = counters[index] = counters.get(index, -1) + 1
            text = self.completions[index][k]
            ids = TOK.encode(text.rstrip("$")) + ([TOK.eod] if text.endswith("$") else [])
            out.append(Generation(prompt_tokens=list(prompt), completion_tokens=ids,
                                  completion_logprobs=[-0.5] * len(ids),
                                  stopped_on_eod=text.endswith("$"),
                                  max_new_tokens=self.budget or sampling.max_new_tokens))
        return out


SAMPLING = Sampling(max_new_tokens=4, eod_id=TOK.eod, seed=100)


def _collect(*args, **kwargs):
    """collect_rollouts with this rank's statistics as metrics (one rank: the global ones)."""
    groups, terms = collect_rollouts(*args, **kwargs)
    return groups, terms.finalize()


def test_rewards_and_group_advantages():
    generator = ScriptedGenerator({0: ["ok$", "no$"], 1: ["ok$", "ok$"]})
    groups, stats = _collect(generator, PromptSource(ScriptedTask(), 0), TOK, SAMPLING,
                                     RolloutConfig(prompts_per_step=2, group_size=2), weight_version=7)
    assert [[r.reward for r in g] for g in groups] == [[1.0, 0.0], [1.0, 1.0]]
    a = 0.5 / (0.5 + 1e-6)  # centered reward / (population std + eps)
    assert [[r.advantage for r in g] for g in groups] == [[pytest.approx(a), pytest.approx(-a)], [0.0, 0.0]]
    assert all(r.weight_version == 7 and not r.truncated for g in groups for r in g)
    assert stats["reward/task_mean"] == 0.75 and stats["rollouts/groups"] == 2


def test_dynamic_sampling_drops_flat_groups_and_refills():
    # prompts 0 and 1 get identical rewards (dropped), prompt 2's verifier crashes (all 0,
    # dropped), prompts 3 and 4 have signal.
    generator = ScriptedGenerator({0: ["ok$", "ok$"], 1: ["x$", "y$"], 2: ["ok$", "ok$"],
                                   3: ["ok$", "no$"], 4: ["no$", "ok$"]})
    config = RolloutConfig(prompts_per_step=2, group_size=2, dynamic_sampling=True, max_rounds=4)
    source = PromptSource(ScriptedTask(), 0)
    groups, stats = _collect(generator, source, TOK, SAMPLING, config, weight_version=0)
    assert [len(g) for g in groups] == [2, 2]
    assert [g[0].prompt_tokens for g in groups] == [TOK.encode("p3\n"), TOK.encode("p4\n")]
    # round 1: 2 prompts (0, 1) both dropped; round 2: prompts 2, 3 -> 2 dropped; round 3: prompt 4
    assert [n for n, _ in generator.calls] == [4, 4, 2]
    assert len({seed for _, seed in generator.calls}) == 3  # each round samples with a new seed
    assert stats["rollouts/groups_dropped"] == 3 and stats["rollouts/rounds"] == 3
    assert stats["rollouts/verifier_failures"] == 2
    # task reward over all 10 generated, dropped too: 2 (prompt 0) + 0 + 0 + 1 + 1 = 4 -> 0.4;
    # over the 4 trained on: 2 / 4
    assert stats["reward/task_mean"] == pytest.approx(0.4)
    assert stats["reward/trained_mean"] == pytest.approx(0.5)
    assert source.position == 5


def test_dynamic_sampling_gives_up_after_max_rounds():
    generator = ScriptedGenerator({i: ["ok$", "ok$"] for i in range(10)})
    config = RolloutConfig(prompts_per_step=2, group_size=2, dynamic_sampling=True, max_rounds=2)
    groups, stats = _collect(generator, PromptSource(ScriptedTask(), 0), TOK, SAMPLING,
                                     config, weight_version=0)
    assert groups == [] and stats["rollouts/rounds"] == 2 and stats["rollouts/groups_dropped"] == 4


def test_overlong_shaping_penalizes_long_completions():
    # budget 4, buffer 2: 'ok' + eod (3 tokens) -> -0.5; 'okkk' truncated (4) -> -1; 'o$' (2) -> 0
    generator = ScriptedGenerator({0: ["ok$", "okkk", "o$"]})
    config = RolloutConfig(prompts_per_step=1, group_size=3, overlong_buffer=2)
    groups, stats = _collect(generator, PromptSource(ScriptedTask(), 0), TOK, SAMPLING,
                                     config, weight_version=0)
    assert [r.reward for r in groups[0]] == [0.5, -1.0, 0.0]
    assert [r.truncated for r in groups[0]] == [False, True, False]
    assert stats["reward/task_mean"] == pytest.approx(1 / 3)  # unshaped task reward


def test_advantages_are_of_the_shaped_rewards_and_centered_only_without_std():
    """The shaped rewards of the test above, [0.5, -1, 0] (task [1, 0, 1]), under
    --rl-no-advantage-std: minus their mean -1/6 -> [2/3, -5/6, 1/6]."""
    generator = ScriptedGenerator({0: ["ok$", "okkk", "o$"]})
    config = RolloutConfig(prompts_per_step=1, group_size=3, overlong_buffer=2, normalize_std=False)
    groups, _ = _collect(generator, PromptSource(ScriptedTask(), 0), TOK, SAMPLING, config,
                         weight_version=0)
    assert [r.advantage for r in groups[0]] == pytest.approx([2 / 3, -5 / 6, 1 / 6])


def test_step_packing_aligns_advantages_and_engine_logprobs(monkeypatch):
    from megatron_rl_bi.rl import step

    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")
    rollouts = [
        Rollout(Generation([5, 6], [7, 8], [-0.25, -0.5]), reward=1.0, group_id=0,
                weight_version=0, advantage=0.5),
        Rollout(Generation([9], [4], [-0.75]), reward=0.0, group_id=0, weight_version=0,
                advantage=-0.5),
    ]
    packed, advantages = step._pack(rollouts)
    # tokens [5 6 7 8 | 9 4]: position j predicts token j + 1 of its sequence
    assert packed.batch.target_ids.tolist() == [6, 7, 8, 0, 4, 0]
    assert packed.batch.completion.tolist() == [False, True, True, False, True, False]
    assert packed.reported.tolist() == [False, True, True, False, True, False]
    assert packed.engine_logprobs.tolist() == [0.0, -0.25, -0.5, 0.0, -0.75, 0.0]
    assert advantages.tolist() == [0.5, 0.5, 0.5, 0.0, -0.5, 0.0]


def test_nonfinite_rewards_score_zero_are_counted_and_keep_advantages_finite():
    generator = ScriptedGenerator({0: ["nan$", "ok$", "no$"]})
    config = RolloutConfig(prompts_per_step=1, group_size=3)
    groups, stats = _collect(generator, PromptSource(ScriptedTask(), 0), TOK, SAMPLING, config,
                             weight_version=0)
    assert [r.reward for r in groups[0]] == [0.0, 1.0, 0.0]
    assert all(torch.isfinite(torch.tensor([r.advantage for r in groups[0]])))
    assert stats["rollouts/nonfinite_rewards"] == 1 and stats["rollouts/verifier_failures"] == 0
    assert stats["reward/task_mean"] == pytest.approx(1 / 3)


def test_dynamic_sampling_filters_on_task_accuracy_not_shaping():
    # equal task rewards (all 1), different lengths: shaping differs, the group is still dropped
    generator = ScriptedGenerator({0: ["ok$", "ok"], 1: ["ok$", "no$"]})
    config = RolloutConfig(prompts_per_step=1, group_size=2, dynamic_sampling=True,
                           overlong_buffer=2)
    groups, stats = _collect(generator, PromptSource(ScriptedTask(), 0), TOK, SAMPLING, config,
                             weight_version=0)
    assert stats["rollouts/groups_dropped"] == 1
    assert [g[0].prompt_tokens for g in groups] == [TOK.encode("p1\n")]


def test_overlong_shaping_uses_the_budget_the_engine_ran_with():
    # asked for 4 new tokens, the engine clamped to 2: 'o$' (2 tokens) is at the budget -> -1
    generator = ScriptedGenerator({0: ["o$", "$"]}, budget=2)
    config = RolloutConfig(prompts_per_step=1, group_size=2, overlong_buffer=2)
    groups, _ = _collect(generator, PromptSource(ScriptedTask(), 0), TOK, SAMPLING, config,
                         weight_version=0)
    assert [r.reward for r in groups[0]] == [-1.0, -0.5]


def test_each_generation_round_reports_its_pace(capsys):
    generator = ScriptedGenerator({0: ["ok$", "no$"], 1: ["ab", "ok$"]})
    _collect(generator, PromptSource(ScriptedTask(), 0), TOK, SAMPLING,
             RolloutConfig(prompts_per_step=2, group_size=2), weight_version=0)
    # 3 + 3 + 2 + 3 tokens ('$' is the end-of-document token)
    assert capsys.readouterr().out.startswith("generation round 1: 4 requests, 11 new tokens in ")
