"""The environment of a multi-turn rollout (`--rl-env MODULE:CLASS` or `FILE.py:CLASS`): a class
built once per sample, with

    reset(example) -> str                       the first observation: the prompt the model sees
    step(text) -> (str, float, bool)            after each sampled turn: the next observation, a
                                                reward, and whether the conversation is over
    stop_strings: tuple[str, ...]               text that ends a sampled turn (e.g. "</search>")
    tools: tuple[dict, ...]                     optional: function schemas of its tags, for
                                                --rl-tool-format chat (envs.tool_format)
    finish() -> float                           optional: the reward of a conversation the turn
                                                or context limit cut (a terminal's task tests)

Each call (the constructor and reset together, then each step) runs on one of a bounded pool of
threads (--rl-env-workers at once; the others wait their turn) with a time limit counted from its
own start (--rl-env-timeout): a call that raises or runs out of time ends its sample with reward 0
and is counted (`rollouts/env_failures`, `rollouts/env_timeouts`); the run goes on, and the first
failure of each kind (exception type and message) is logged with its traceback. A timed-out
call's thread is left to finish on its own (a thread cannot be killed) and a new worker takes its
place, so a hung environment does not shrink the pool: tools that can hang should bound themselves
too, as the built-in code sandbox does with a subprocess.
"""

import functools
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from megatron_rl_bi.envs.code import code_environment
from megatron_rl_bi.envs.plugins import load_plugin
from megatron_rl_bi.envs.sandbox import SandboxConfig
from megatron_rl_bi.envs.retrieval import RemoteRetriever
from megatron_rl_bi.envs.search import Retriever, read_corpus, search_environment
from megatron_rl_bi.envs.terminal import terminal_environment

logger = logging.getLogger(__name__)

FAILED, TIMED_OUT = "env_failures", "env_timeouts"


def build_environment(spec: str, task, search_corpus: str | None = None, search_top_k: int = 3,
                      code_sandbox: SandboxConfig | None = None,
                      search_server: RemoteRetriever | None = None) -> type:
    """The environment class of --rl-env: the built-in 'search' (a retrieval server's, or BM25 over
    --rl-search-corpus or the task's own corpus), 'code' (programs run in `code_sandbox`) or
    'terminal' (commands run there, with the system's shell), or a user's class."""
    if spec == "code":
        return code_environment(code_sandbox or SandboxConfig())
    if spec == "terminal":
        return terminal_environment(code_sandbox or SandboxConfig())
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


def default_workers() -> int:
    """--rl-env-workers' default: 8 a CPU this process may use (environment calls mostly wait, on a
    sandboxed program or a server)."""
    return 8 * len(os.sched_getaffinity(0))


def call_all(calls: list[Callable[[], object]], timeout_s: float, workers: int | None = None) -> list[Outcome]:
    """Every call on the pool of `workers` threads (default_workers() when None), in order; each
    call has `timeout_s` from its own start, after which it has TIMED_OUT (whatever it returns
    later is dropped)."""
    return _pool(default_workers() if workers is None else workers).call_all(calls, timeout_s)


@functools.cache
def _pool(workers: int) -> "EnvironmentPool":
    return EnvironmentPool(workers)


@dataclass
class _Job:
    call: Callable[[], object]
    outcome: Outcome = field(default_factory=Outcome)
    started_at: float | None = None
    started: threading.Event = field(default_factory=threading.Event)
    done: threading.Event = field(default_factory=threading.Event)
    abandoned: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)


class EnvironmentPool:
    """At most `workers` calls run at once, on daemon threads (a hung one does not keep the
    process alive) that take queued calls in order."""

    def __init__(self, workers: int):
        if workers < 1:
            raise ValueError(f"--rl-env-workers must be >= 1, got {workers}")
        self.replaced = 0
        self._jobs: queue.SimpleQueue[_Job] = queue.SimpleQueue()
        for _ in range(workers):
            self._start_worker()

    def _start_worker(self) -> None:
        threading.Thread(target=self._work, daemon=True).start()

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            job.started_at = time.monotonic()
            job.started.set()
            _run_into(job.call, job.outcome)
            with job.lock:
                job.done.set()
                if job.abandoned:  # timed out: a new worker has its place
                    return

    def call_all(self, calls: list[Callable[[], object]], timeout_s: float) -> list[Outcome]:
        jobs = [_Job(call) for call in calls]
        for job in jobs:
            self._jobs.put(job)
        for job in jobs:  # a worker takes each only after every job before it started
            job.started.wait()
            job.done.wait(max(0.0, job.started_at + timeout_s - time.monotonic()))
            with job.lock:
                if not job.done.is_set():
                    job.abandoned = True
                    self.replaced += 1
                    self._start_worker()
        return [Outcome(problem=TIMED_OUT) if job.abandoned else job.outcome for job in jobs]


def _run_into(call: Callable[[], object], outcome: Outcome) -> None:
    try:
        outcome.value = call()
    except Exception as exc:  # noqa: BLE001 - a user's environment: whatever it raises ends its sample
        outcome.problem = FAILED
        _log_first_of_its_kind(exc)


_logged_failures: set[tuple[str, str]] = set()
_logged_failures_lock = threading.Lock()


def _log_first_of_its_kind(exc: Exception) -> None:
    """A failure's traceback, once for each exception type and message: a counted failure with
    no reason is a bug nobody can find, and one message a sample would flood the log."""
    kind = (type(exc).__qualname__, str(exc)[:200])
    with _logged_failures_lock:
        if kind in _logged_failures:
            return
        _logged_failures.add(kind)
    logger.warning("an environment call raised %s: %s (its sample scores 0, counted in "
                   "rollouts/env_failures; logged once)", kind[0], exc, exc_info=exc)
