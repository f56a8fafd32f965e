"""--rl-reward-fn: a user's reward replaces the task's verifier, loads from a module or a file,
fails before any GPU work with the flag named, and runs under the reward guard."""


import pytest

from megatron_rl_bi.envs import build_task
from megatron_rl_bi.envs.reward_fn import RewardFnTask, load_reward_fn
from megatron_rl_bi.rl.rewards import safe_reward

from .. import REPO


def test_reward_fn_from_a_file_replaces_the_verifier(tmp_path):
    (tmp_path / "my_reward.py").write_text(
        "def length_reward(prompt, completion, example):\n"
        "    assert prompt == example.prompt\n"
        "    return float(len(completion)) if completion != 'nan' else float('nan')\n")
    fn = load_reward_fn(f"{tmp_path / 'my_reward.py'}:length_reward")
    task = RewardFnTask(build_task("sort", seed=0), fn)
    example = task.example(3)
    assert example.prompt == build_task("sort", seed=0).example(3).prompt
    assert safe_reward(example.verify, "abcd") == (4.0, None)
    assert safe_reward(example.verify, "nan") == (0.0, "nonfinite")


def test_reward_fn_from_a_module(tmp_path, monkeypatch):
    (tmp_path / "team_rewards.py").write_text("def exact(prompt, completion, example):\n"
                                              "    return float(completion == example.answer)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    fn = load_reward_fn("team_rewards:exact")
    example = RewardFnTask(build_task("sort", seed=0), fn).example(0)
    assert example.verify(example.answer) == 1.0 and example.verify("zz") == 0.0


@pytest.mark.parametrize("spec,message", [
    ("no_colon", "expected MODULE:NAME"),
    ("no_such_module_xyz:f", "cannot load no_such_module_xyz"),
    ("missing.py:f", "cannot load missing.py"),
    ("megatron_rl_bi.envs.verifiers:nope", "has no 'nope'"),
    ("megatron_rl_bi.envs.verifiers:re", "is not callable"),
])
def test_bad_specs_name_the_flag(spec, message):
    with pytest.raises(ValueError, match=f"--rl-reward-fn {spec}: .*{message}"):
        load_reward_fn(spec)


@pytest.mark.parametrize("source,accepted", [
    ("def f(prompt, completion):\n    return 1.0\n", False),  # the pre-flight passed it: every call failed
    ("def f(prompt, completion, example, strict):\n    return 1.0\n", False),
    ("def f(prompt, completion, example, strict=True):\n    return 1.0\n", True),
    ("def f(*args):\n    return 1.0\n", True),
    ("class f:\n    def __call__(self, prompt, completion, example):\n        return 1.0\n", False),  # the class
])
def test_a_reward_fn_that_cannot_take_the_three_arguments_is_refused_at_load(tmp_path, source, accepted):
    (tmp_path / "rewards.py").write_text(source)
    spec = f"{tmp_path / 'rewards.py'}:f"
    if accepted:
        assert callable(load_reward_fn(spec))
        return
    with pytest.raises(ValueError, match=r"--rl-reward-fn .*rewards.py:f: f\(.*\) cannot be called as \(prompt, completion, example\)"):
        load_reward_fn(spec)


def test_the_sizing_reward_counts_number_words():
    number_share = load_reward_fn(f"{REPO}/examples/reward_fns/number_share.py:number_share")
    assert number_share("p", "7 w1 12 w3", None) == 0.5
    assert number_share("p", "", None) == 0.0
