"""The environment of a multi-turn rollout (`--rl-env MODULE:CLASS` or `FILE.py:CLASS`): a class
built once per sample, with

    reset(example) -> str                       the first observation: the prompt the model sees
    step(text) -> (str, float, bool)            after each sampled turn: the next observation, a
                                                reward, and whether the conversation is over
    stop_strings: tuple[str, ...]               text that ends a sampled turn (e.g. "</search>")
    tools: tuple[dict, ...]                     optional: function schemas of its tags, for
                                                --rl-tool-format chat (envs.tool_format)

Each call (the constructor and reset together, then each step) runs on a thread of its own with
a time limit (--rl-env-timeout): a call that raises or runs out of time ends its sample with
reward 0 and is counted (`rollouts/env_failures`, `rollouts/env_timeouts`); the run goes on. A
timed-out call's thread is left to finish on its own (a thread cannot be killed): tools that can
hang should bound themselves too, as the built-in code sandbox does with a subprocess.
"""

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from megatron_rl_bi.envs.code import code_environment
from megatron_rl_bi.envs.plugins import load_plugin
from megatron_rl_bi.envs.sandbox import SandboxConfig
from megatron_rl_bi.envs.retrieval import RemoteRetriever
from megatron_rl_bi.envs.search import Retriever, read_corpus, search_environment

FAILED, TIMED_OUT = "env_failures", "env_timeouts"


def build_environment(spec: str, task, search_corpus: str | None = None, search_top_k: int = 3,
                      code_sandbox: SandboxConfig | None = None,
                      search_server: RemoteRetriever | None = None) -> type:
    """The environment class of --rl-env: the built-in 'search' (a retrieval server's, or BM25 over
    --rl-search-corpus or the task's own corpus) or 'code' (programs run in `code_sandbox`), or a
    user's class."""
    if spec == "code":
        return code_environment(code_sandbox or SandboxConfig())
    if spec != "search":
        return load_environment(spec)
    if search_server is not None:
        return search_environment(search_server, search_top_k)
    passages = read_corpus(search_corpus) if search_corpus else getattr(task, "corpus", None)
    if passages is None:
        raise ValueError("--rl-env search needs --rl-search-corpus FILE or --rl-search-url URL (or a "
                         "task with its own corpus, --rl-task lookup)")
    return search_environment(Retriever(passages), search_top_k)


def load_environment(spec: str) -> type:
    """The environment class `spec` names (--rl-env); one ValueError naming the flag when it
    cannot be had or lacks the interface."""
    environment = load_plugin(spec, "--rl-env")
    missing = [name for name in ("reset", "step", "stop_strings") if not hasattr(environment, name)]
    if not isinstance(environment, type) or missing:
        raise ValueError(f"--rl-env {spec}: expected a class with reset(example), step(text) and "
                         f"stop_strings" + (f"; it lacks {', '.join(missing)}" if missing else ""))
    return environment


@dataclass
class Outcome:
    """What one guarded call gave: its value, or the problem that ended it (FAILED, TIMED_OUT)."""

    value: object = None
    problem: str | None = None


def call_all(calls: list[Callable[[], object]], timeout_s: float) -> list[Outcome]:
    """Every call at once, each on a daemon thread (a hung one does not keep the process alive),
    all waited for until `timeout_s` after the start; a call still running then has TIMED_OUT
    (whatever it returns later is dropped)."""
    recorded = [Outcome() for _ in calls]
    threads = [threading.Thread(target=_run_into, args=(call, outcome), daemon=True)
               for call, outcome in zip(calls, recorded)]
    deadline = time.monotonic() + timeout_s
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    return [Outcome(problem=TIMED_OUT) if thread.is_alive() else outcome
            for thread, outcome in zip(threads, recorded)]


def _run_into(call: Callable[[], object], outcome: Outcome) -> None:
    try:
        outcome.value = call()
    except Exception:  # noqa: BLE001 - a user's environment: whatever it raises ends its sample
        outcome.problem = FAILED
