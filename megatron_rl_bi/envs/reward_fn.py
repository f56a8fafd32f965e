"""A user's reward function in place of a task's verifier: `--rl-reward-fn MODULE:FUNCTION` (an
importable module) or `--rl-reward-fn path/to/file.py:FUNCTION`, a callable
`(prompt, completion, example) -> float` (`example` has `.prompt` and `.answer`). It runs under
the same guard as the built-in verifiers: an exception or a non-finite value scores 0 and is
counted, never fatal."""

import dataclasses
import functools
import inspect
from collections.abc import Callable

from megatron_rl_bi.envs.plugins import load_plugin
from megatron_rl_bi.envs.tasks import Example


def load_reward_fn(spec: str) -> Callable:
    """The callable `spec` names; one ValueError naming the flag when it cannot be had."""
    function = load_plugin(spec, "--rl-reward-fn")
    if not callable(function):
        raise ValueError(f"--rl-reward-fn {spec}: {function!r} is not callable")
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):  # a builtin without one: it is called and guarded as it is
        return function
    try:
        signature.bind("prompt", "completion", "example")
    except TypeError:
        raise ValueError(f"--rl-reward-fn {spec}: {getattr(function, '__name__', 'it')}{signature} cannot be "
                         "called as (prompt, completion, example)") from None
    return function


def _user_reward(reward_fn: Callable, example: Example, completion: str) -> float:
    return reward_fn(example.prompt, completion, example)


def with_reward_fn(example: Example, reward_fn: Callable) -> Example:
    """`example` scored by `reward_fn` instead of its own verifier."""
    return dataclasses.replace(example, verify=functools.partial(_user_reward, reward_fn, example))


class RewardFnTask:
    """A task whose examples are scored by a user's reward function."""

    def __init__(self, task, reward_fn: Callable):
        self.task, self.reward_fn, self.size = task, reward_fn, task.size

    def example(self, index: int) -> Example:
        return with_reward_fn(self.task.example(index), self.reward_fn)
