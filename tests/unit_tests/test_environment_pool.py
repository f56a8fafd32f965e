"""The environment pool (envs.environment, --rl-env-workers), CPU: at most N calls at once, each
timed from its own start, a hung call's worker replaced, outcomes in the calls' order; and the
built-in search environment's corpus."""

import json
import threading
import time

import pytest

from megatron_rl_bi.envs.environment import (FAILED, TIMED_OUT, EnvironmentPool, build_environment, call_all,
                                             default_workers)
from megatron_rl_bi.envs.tasks import LookupTask


class Running:
    """Counts the calls running at once, and the most seen."""

    def __init__(self):
        self.now = self.most = 0
        self.lock = threading.Lock()

    def call(self, value, seconds=0.05):
        with self.lock:
            self.now += 1
            self.most = max(self.most, self.now)
        time.sleep(seconds)
        with self.lock:
            self.now -= 1
        return value


def test_at_most_workers_calls_run_at_once_and_outcomes_keep_the_calls_order():
    running = Running()
    outcomes = EnvironmentPool(3).call_all([lambda i=i: running.call(i) for i in range(12)], timeout_s=5)
    assert [o.value for o in outcomes] == list(range(12)) and running.most == 3


def test_a_queued_call_has_its_whole_limit_from_its_own_start():
    """With one worker, the second call starts after the first's 0.3 s: a deadline counted from
    the batch's start (0.4 s) would time it out."""
    outcomes = EnvironmentPool(1).call_all([lambda: time.sleep(0.3) or 1, lambda: time.sleep(0.3) or 2],
                                           timeout_s=0.4)
    assert [(o.value, o.problem) for o in outcomes] == [(1, None), (2, None)]


def test_a_call_that_ran_beside_an_earlier_one_is_timed_from_its_own_start_not_the_earlier_s_end():
    """Two workers: both calls start at once; the first ends at 0.5 s, the second runs 1.2 s past
    its 1 s limit, which must not restart when the pool turns to it at 0.5 s."""
    outcomes = EnvironmentPool(2).call_all([lambda: time.sleep(0.5) or 1, lambda: time.sleep(1.2) or 2],
                                           timeout_s=1.0)
    assert [(o.value, o.problem) for o in outcomes] == [(1, None), (None, TIMED_OUT)]


def _within(seconds, function):
    """function()'s value, or a failure when it has not returned within `seconds` (a pool that
    lost its worker would wait forever)."""
    result = []
    thread = threading.Thread(target=lambda: result.append(function()), daemon=True)
    thread.start()
    thread.join(seconds)
    assert result, f"no result within {seconds} s"
    return result[0]


def test_a_hung_call_times_out_and_its_worker_is_replaced():
    release = threading.Event()
    pool = EnvironmentPool(1)
    started = time.monotonic()
    outcomes = _within(5, lambda: pool.call_all([release.wait, lambda: 2, lambda: 1 / 0], timeout_s=0.3))
    assert [(o.value, o.problem) for o in outcomes] == [(None, TIMED_OUT), (2, None), (None, FAILED)]
    assert time.monotonic() - started < 2 and pool.replaced == 1
    running = Running()  # the pool still runs one call at a time, not two
    pool.call_all([lambda: running.call(0), lambda: running.call(1)], timeout_s=5)
    assert running.most == 1
    release.set()  # the hung call ends: its late value is dropped, its thread leaves the pool
    time.sleep(0.1)
    assert outcomes[0].problem == TIMED_OUT and outcomes[0].value is None
    running = Running()
    pool.call_all([lambda: running.call(0), lambda: running.call(1)], timeout_s=5)
    assert running.most == 1


def test_the_default_pool_is_sized_from_the_cpus_and_a_size_below_one_is_refused():
    assert default_workers() >= 8
    running = Running()
    call_all([lambda: running.call(0, 0.2)] * 20, timeout_s=5, workers=4)
    assert running.most == 4
    with pytest.raises(ValueError, match="--rl-env-workers must be >= 1, got 0"):
        EnvironmentPool(0)
    with pytest.raises(ValueError, match="--rl-env-workers must be >= 1, got 0"):  # not the default
        call_all([lambda: 1], timeout_s=5, workers=0)


def test_call_all_reuses_one_pool_and_does_not_add_threads_each_round():
    """Each rollout turn calls call_all: a pool built per call would leave its idle workers
    behind, `workers` more threads every turn."""
    call_all([lambda: 0] * 5, timeout_s=5, workers=5)
    after_first = threading.active_count()
    for round_ in range(20):
        assert [o.value for o in call_all([lambda: round_] * 5, timeout_s=5, workers=5)] == [round_] * 5
    assert threading.active_count() <= after_first


def test_an_explicit_search_corpus_is_searched_not_the_lookup_task_s_own(tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    passages = ["The Eiffel Tower is in Paris.", "Mount Fuji is the highest mountain in Japan."]
    corpus.write_text("".join(json.dumps({"contents": p}) + "\n" for p in passages))
    task = LookupTask(seed=0, corpus_size=8)
    environment = build_environment("search", task, search_corpus=str(corpus), search_top_k=1)
    assert environment.retriever.passages == passages
    assert environment.retriever.search("highest mountain of Japan", 1) == [passages[1]]


def test_a_failure_is_logged_with_its_traceback_once_for_each_kind(caplog):
    def broken(message):
        raise KeyError(message)

    calls = [lambda: broken("log test files")] * 3 + [lambda: broken("log test tests")] + [lambda: 7]
    with caplog.at_level("WARNING", logger="megatron_rl_bi.envs.environment"):
        outcomes = EnvironmentPool(2).call_all(calls, timeout_s=5)
    assert [o.problem for o in outcomes] == [FAILED] * 4 + [None]
    logged = [r for r in caplog.records if "an environment call raised KeyError" in r.getMessage()]
    assert sorted(r.getMessage().split(": ", 1)[1].split(" (")[0] for r in logged) == ["'log test files'", "'log test tests'"]
    assert all(r.exc_info and "in broken" in caplog.text for r in logged)
