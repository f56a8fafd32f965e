"""Environment answers written down and played back (--rl-env-record FILE, --rl-env-replay FILE).

A BI run repeats bit for bit only while its environment answers the same: a terminal does not
(the processes of `a | b` or `a & b` write to one stream in the kernel's scheduling order, and
dash writes one message in several writes, so lines of two processes interleave), nor does a
retrieval server whose index was rebuilt. A run with --rl-env-record writes every answer of its
environment (the prompt it opened with, each turn's observation, reward and end, each cut
conversation's score, each failure and timeout) to FILE; a run with --rl-env-replay FILE calls no
environment and plays those answers back, so it repeats the recorded run bit for bit, or stops at
the first conversation whose model turn differs from the recording's, naming it: the engine, the
trainer or the sampling changed.

Each run_conversations call is one JSON line, keyed by its sampling seed (a function of the run's
seed, the step, the data-parallel rank and the generation round): a resumed run, a rank, a
generator apart find their own lines. A path ending in `.gz` is gzip-compressed. Lines are
appended, one write each (a resumed run adds its steps to its first segment's file).
"""

import functools
import gzip
import json
import os
import threading
from collections import defaultdict
from collections.abc import Callable

from megatron_rl_bi.envs.environment import Outcome, call_all
from megatron_rl_bi.jsonfile import parse_object


class ReplayMismatch(ValueError):
    """The run asked its environment something the recording's run did not."""


def _read_text(path: str):
    return (gzip.open if path.endswith(".gz") else open)(path, "rt", encoding="utf-8")


@functools.cache
def read_recording(path: str) -> dict[int, list[dict]]:
    """The recording's lines by seed, in file order (read once a process)."""
    by_seed = defaultdict(list)
    with _read_text(path) as f:
        for number, line in enumerate(f, start=1):
            if line.strip():
                record = parse_object(line, path, number)
                if not isinstance(record.get("seed"), int) or not isinstance(record.get("calls"), list):
                    raise ValueError(f"{path}:{number}: not a recording line (expected 'seed' and 'calls')")
                by_seed[record["seed"]].append(record)
    return by_seed


_taken: defaultdict[tuple[str, int], int] = defaultdict(int)
_lock = threading.Lock()


class EnvironmentCalls:
    """The environment's outcomes of one run_conversations call: the calls run on the pool
    (envs.environment.call_all), and written down with `record`; or, with `replay`, the
    recording's outcomes for the same seed, the calls not made. `encode`/`decode` turn a kind of
    call's value into JSON and back."""

    def __init__(self, seed: int, timeout_s: float, workers: int | None, record: str | None = None,
                 replay: str | None = None):
        self.seed, self.timeout_s, self.workers, self.record, self.replay = seed, timeout_s, workers, record, replay
        self.calls: list[dict] = []
        if replay is not None:
            with _lock:
                occurrence = _taken[replay, seed]
                _taken[replay, seed] += 1
            recorded = read_recording(replay).get(seed, [])
            if occurrence >= len(recorded):
                again = f" beyond the {occurrence} this run played back" if occurrence else ""
                raise ReplayMismatch(f"--rl-env-replay {replay}: no recorded conversations for sampling seed "
                                     f"{seed}{again}: the recording is of another run, or of a shorter one")
            self.recorded = recorded[occurrence]["calls"]

    def __call__(self, kind: str, inputs: list, calls: list[Callable[[], object]],
                 encode: Callable = lambda v: v, decode: Callable = lambda v: v) -> list[Outcome]:
        """The outcomes of `calls` (one per input; `inputs`, JSON, say what was asked)."""
        if self.replay is not None:
            return self._played(kind, inputs, decode)
        outcomes = call_all(calls, self.timeout_s, self.workers)
        if self.record is not None:
            self.calls.append({"kind": kind, "inputs": inputs, "outcomes": [
                {"problem": o.problem} if o.problem else {"value": encode(o.value)} for o in outcomes]})
        return outcomes

    def _played(self, kind: str, inputs: list, decode: Callable) -> list[Outcome]:
        index = len(self.calls)
        self.calls.append({})
        where = f"--rl-env-replay {self.replay}: sampling seed {self.seed}, environment call {index + 1}"
        if index >= len(self.recorded) or self.recorded[index]["kind"] != kind:
            found = self.recorded[index]["kind"] if index < len(self.recorded) else "nothing"
            raise ReplayMismatch(f"{where}: the run asks for '{kind}', the recording has {found}")
        recorded = self.recorded[index]
        asked = json.loads(json.dumps(inputs))  # as the recording holds them (tuples as lists)
        if asked != recorded["inputs"]:
            if len(asked) != len(recorded["inputs"]):
                raise ReplayMismatch(f"{where} ({kind}): the run asks {len(asked)} conversations, the "
                                     f"recording {len(recorded['inputs'])}")
            j = next(j for j, (a, b) in enumerate(zip(asked, recorded["inputs"])) if a != b)
            raise ReplayMismatch(f"{where} ({kind}), conversation {j}: the run sent {asked[j]!r:.200}, the "
                                 f"recording has {recorded['inputs'][j]!r:.200}: the run parted from the "
                                 "recorded one before the environment answered")
        return [Outcome(problem=o["problem"]) if "problem" in o else Outcome(decode(o["value"]))
                for o in recorded["outcomes"]]

    def close(self) -> None:
        """With `record`, this call's line appended to the recording in one write."""
        if self.record is None:
            return
        line = json.dumps({"seed": self.seed, "calls": self.calls}, separators=(",", ":")) + "\n"
        if self.record.endswith(".gz"):
            data = gzip.compress(line.encode())  # a member of its own: the file stays one gzip stream
        else:
            data = line.encode()
        descriptor = os.open(self.record, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(descriptor, data)
        finally:
            os.close(descriptor)
