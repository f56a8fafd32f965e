"""--rl-env-record and --rl-env-replay on CPU, with a scripted engine: a replayed run calls no
environment and equals the recorded one (answers, failures, timeouts, cut conversations' scores),
even where the environment never answers the same twice (a terminal's concurrent processes); a
run that parts from its recording stops, naming the conversation; lines are found by sampling
seed; the flags' errors come before any GPU work."""

import dataclasses
import itertools
import re
import shutil
import time

import pytest

from megatron_rl_bi.config.rl_args import parse_rl_args
from megatron_rl_bi.envs import Example
from megatron_rl_bi.envs.environment import FAILED, TIMED_OUT
from megatron_rl_bi.envs import PromptSource
from megatron_rl_bi.envs.recording import EnvironmentCalls, ReplayMismatch, read_recording
from megatron_rl_bi.envs.sandbox import SandboxConfig
from megatron_rl_bi.envs.terminal import TerminalTask, terminal_environment
from megatron_rl_bi.rl.conversations import TurnConfig, run_conversations
from megatron_rl_bi.rl.rollouts import RolloutConfig, collect_rollouts

from ..sandbox_fixtures import sandbox_python
from .test_conversations import SAMPLING, TOK, Broken, KeyTask, KeyValue, ScriptedEngine
from .test_search_env import COMMON

EXAMPLES = [Example(prompt="find k\n", answer="v", verify=None)] * 3


class Drifting(KeyValue):
    """Never answers the same twice (a counter shared by every instance); counts its builds."""

    builds = 0
    answers = itertools.count()

    def __init__(self):
        Drifting.builds += 1

    def step(self, text):
        if text.endswith("</s>"):
            return f"={next(Drifting.answers)};", 0.0, False
        return "", float(next(Drifting.answers) % 2), True


class Finishing(Drifting):
    """Scores a cut conversation, never the same twice."""

    def finish(self):
        return 0.5 + next(Drifting.answers)


def converse(config, engine_turns=("<s>k</s>", "<a>v</a>$"), environment=Drifting, examples=EXAMPLES,
             sampling=SAMPLING, context=64):
    engine = ScriptedEngine(list(engine_turns), max_sequence_length=context)
    generations, scores, counts = run_conversations(engine, examples, environment, TOK, sampling, config)
    counts.pop("env_seconds")
    return generations, scores, counts


def test_a_replayed_run_calls_no_environment_and_equals_the_recorded_one(tmp_path):
    recording = str(tmp_path / "env.jsonl")
    recorded = converse(TurnConfig(max_turns=3, record=recording))
    assert converse(TurnConfig(max_turns=3)) != recorded  # live, the environment answers otherwise
    builds = Drifting.builds
    assert converse(TurnConfig(max_turns=3, replay=recording)) == recorded
    assert Drifting.builds == builds
    assert [TOK.decode(g.completion_tokens)[:9] for g in recorded[0]] == ["<s>k</s>="] * 3


def test_failures_timeouts_and_cut_conversations_scores_are_played_back(tmp_path):
    recording = str(tmp_path / "env.jsonl")
    examples = [Example(prompt="find k\n", answer=a, verify=None) for a in ("bad", "slow", "nan", "v", "v")]
    Broken.builds_left = 4  # the fifth fails to build
    recorded = converse(TurnConfig(env_timeout_s=0.5, record=recording), ("<a>v</a>$",), Broken, examples)
    assert recorded[1] == [(0.0, FAILED), (0.0, TIMED_OUT), (0.0, FAILED), (1.0, None), (0.0, FAILED)]
    started = time.monotonic()
    assert converse(TurnConfig(env_timeout_s=0.5, replay=recording), ("<a>v</a>$",), Broken, examples) == recorded
    assert time.monotonic() - started < 0.5  # the timeout is played back, not waited for

    cut_recording = str(tmp_path / "cut.jsonl")
    cut = converse(TurnConfig(max_turns=1, record=cut_recording), environment=Finishing)
    assert all(score % 1 == 0.5 for score, _ in cut[1])  # scored by finish
    assert converse(TurnConfig(max_turns=1, replay=cut_recording), environment=Finishing) == cut


def test_a_run_that_parts_from_its_recording_stops_naming_the_conversation(tmp_path):
    recording = str(tmp_path / "env.jsonl")
    converse(TurnConfig(max_turns=3, record=recording))
    engine = ScriptedEngine(["<s>k</s>", "<a>w</a>$"])
    with pytest.raises(ReplayMismatch, match=r"sampling seed 0, environment call 3 \(step\), conversation 0: the "
                                             r"run sent '<a>w</a>', the recording has '<a>v</a>'"):
        run_conversations(engine, EXAMPLES, Drifting, TOK, SAMPLING, TurnConfig(max_turns=3, replay=recording))
    with pytest.raises(ReplayMismatch, match="no recorded conversations for sampling seed 5"):
        converse(TurnConfig(max_turns=3, replay=recording), sampling=dataclasses.replace(SAMPLING, seed=5))
    shutil.copy(recording, tmp_path / "fewer.jsonl")
    with pytest.raises(ReplayMismatch, match=r"environment call 1 \(open\): the run asks 2 conversations, the recording 3"):
        converse(TurnConfig(max_turns=3, replay=str(tmp_path / "fewer.jsonl")), examples=EXAMPLES[:2])


def test_a_run_that_asks_another_kind_of_call_stops_naming_both(tmp_path):
    """One turn then the cut conversations' scores are recorded; a run of more turns asks for a
    second turn where the recording has the scores, and, without them, where it has nothing."""
    scored, unscored = str(tmp_path / "scored.jsonl"), str(tmp_path / "unscored.jsonl")
    converse(TurnConfig(max_turns=1, record=scored), environment=Finishing)
    converse(TurnConfig(max_turns=1, record=unscored))
    with pytest.raises(ReplayMismatch, match=r"environment call 3: the run asks for 'step', the recording has finish"):
        converse(TurnConfig(max_turns=3, replay=scored), environment=Finishing)
    with pytest.raises(ReplayMismatch, match=r"environment call 3: the run asks for 'step', the recording has nothing"):
        converse(TurnConfig(max_turns=3, replay=unscored))


def test_what_was_asked_is_compared_as_the_recording_holds_it(tmp_path):
    """Inputs go through JSON before they are compared: a tuple asked is the list recorded."""
    recording = str(tmp_path / "env.jsonl")
    recorder = EnvironmentCalls(11, 1.0, 1, record=recording)
    assert recorder("open", [("k", 1)], [lambda: "x"])[0].value == "x"
    recorder.close()
    player = EnvironmentCalls(11, 1.0, 1, replay=recording)
    assert player("open", [("k", 1)], [lambda: pytest.fail("called")])[0].value == "x"


@pytest.mark.parametrize("name", ["env.jsonl", "env.jsonl.gz"])
def test_lines_are_found_by_seed_and_a_seed_s_rounds_in_order(tmp_path, name):
    recording = str(tmp_path / name)
    seeds = (7, 3, 7)  # a seed met twice: its rounds are played back in the order they were recorded
    recorded = [converse(TurnConfig(max_turns=3, record=recording), sampling=dataclasses.replace(SAMPLING, seed=s))
                for s in seeds]
    for index in (1, 0, 2):  # seed 3 first: lines are looked up, not read in file order
        assert converse(TurnConfig(max_turns=3, replay=recording),
                        sampling=dataclasses.replace(SAMPLING, seed=seeds[index])) == recorded[index]


def test_a_terminal_conversation_replays_what_its_concurrent_processes_wrote(tmp_path):
    """Three background jobs write to stderr in the kernel's order; the replay has the recorded
    one; the cut conversation's task test is played back too."""
    environment = terminal_environment(SandboxConfig(python=sandbox_python(), seconds=3.0, memory_mb=512))
    examples = [Example(prompt="x\n", answer="", verify=None, terminal=TerminalTask("x", "test -f o"))]
    turn = ("<bash>ls 1&ls 2&ls 3;echo>o</bash>",)
    sampling, recording = dataclasses.replace(SAMPLING, max_new_tokens=64), str(tmp_path / "terminal.jsonl")
    [recorded], scores, _ = converse(TurnConfig(max_turns=1, record=recording), turn, environment, examples,
                                     sampling, context=512)
    assert scores == [(1.0, None)] and TOK.decode(recorded.completion_tokens).count("No such file") == 3
    for copy in range(3):  # a process plays a seed's line back once: a copy a replay
        replay = shutil.copy(recording, tmp_path / f"copy{copy}.jsonl")
        assert converse(TurnConfig(max_turns=1, replay=str(replay)), turn, environment, examples, sampling,
                        context=512)[:2] == ([recorded], scores)


@pytest.mark.parametrize("flags,error", [
    (["--rl-env-record", "{tmp}/r.jsonl", "--rl-env-replay", "{tmp}/r.jsonl"], "exclude each other"),
    (["--rl-env-replay", "{tmp}/none.jsonl"], "--rl-env-replay {tmp}/none.jsonl: no such file"),
    (["--rl-env-replay", "{tmp}/bad.jsonl"], "{tmp}/bad.jsonl:2: not JSON"),
    (["--rl-env-replay", "{tmp}/other.jsonl"], "{tmp}/other.jsonl:1: not a recording line"),
    (["--rl-env-record", "{tmp}/no/r.jsonl"], "--rl-env-record {tmp}/no/r.jsonl: its directory does not exist"),
])
def test_the_flags_bad_values_are_named_before_any_gpu_work(tmp_path, flags, error):
    (tmp_path / "r.jsonl").write_text("")
    (tmp_path / "bad.jsonl").write_text('{"seed": 1, "calls": []}\n{"seed": 2,\n')
    (tmp_path / "other.jsonl").write_text('{"step": 1}\n')
    with pytest.raises(ValueError, match=re.escape(error.format(tmp=tmp_path))):
        parse_rl_args(COMMON + ["--rl-env", "search", "--rl-task", "lookup", *[f.format(tmp=tmp_path) for f in flags]])
    with pytest.raises(ValueError, match="--rl-env-record records the answers of --rl-env, which is not set"):
        parse_rl_args(COMMON + ["--rl-env-record", str(tmp_path / "r.jsonl")])
    with pytest.raises(ValueError, match="--rl-env-replay plays back the answers of --rl-env, which is not set"):
        parse_rl_args(COMMON + ["--rl-env-replay", str(tmp_path / "r.jsonl")])


def test_a_step_s_generation_rounds_are_each_played_back(tmp_path):
    """Dynamic sampling's rounds (each its own sampling seed) through collect_rollouts: recorded,
    then played back round by round, the same groups; a group of equal rewards refills."""
    recording = str(tmp_path / "env.jsonl")

    class Late(Drifting):
        """Rewards 0 for the first round's four answers (no group to learn from: a refill), then
        alternating, in whatever order the pool's threads answer."""

        answered = itertools.count()

        def step(self, text):
            observation, _, done = super().step(text)
            n = next(Late.answered) if done else 0
            return observation, float(n >= 4 and n % 2), done

    def step(turns):
        config = RolloutConfig(prompts_per_step=2, group_size=2, environment=Late, dynamic_sampling=True,
                               max_rounds=3, turns=turns)
        groups, terms = collect_rollouts(ScriptedEngine(["<s>k</s>", "<a>v</a>$"]), PromptSource(KeyTask(), 0),
                                         TOK, SAMPLING, config, weight_version=0)
        metrics = terms.finalize()
        return [[(r.reward, r.completion_tokens) for r in g] for g in groups], metrics["rollouts/rounds"]

    recorded, rounds = step(TurnConfig(max_turns=3, record=recording))
    assert rounds > 1 and len(read_recording(recording)) == rounds  # a line a round, each its seed
    assert step(TurnConfig(max_turns=3, replay=recording)) == (recorded, rounds)
