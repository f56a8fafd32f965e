"""The terminal environment (CPU, the real sandbox: bubblewrap, as in test_sandbox.py): files
outlive a turn and nothing else does, a command killed at its limit leaves the files as they
were, the keeper's answer cannot be forged or read by the command, the task's tests stay hidden
until scoring, the budget ends a conversation, the task file's errors name FILE:LINE, and every
shipped task's solution passes its test where doing nothing fails."""

import dataclasses
import json
import os
import subprocess
import sys
import time
from collections import Counter

import pytest

from megatron_rl_bi.envs import sandbox
from megatron_rl_bi.envs.environment import build_environment
from megatron_rl_bi.envs.recording import EnvironmentCalls
from megatron_rl_bi.envs.tasks import TerminalTasks, build_task
from megatron_rl_bi.envs.terminal import read_tasks, terminal_environment
from megatron_rl_bi.rl import conversations

from .. import REPO
from ..sandbox_fixtures import sandbox_python

SHIPPED = REPO / "examples" / "tasks" / "terminal_tiny.jsonl"
SORT_TASK = {"instruction": "sort ab into cd\n", "files": {"ab": "b\nc\na\n"},
             "tests": {"check.sh": "printf 'a\\nb\\nc\\n' | cmp -s - cd\n"}, "test": "sh .tests/check.sh",
             "solution": "sort ab > cd", "seconds": 10}


@pytest.fixture(scope="module")
def config():
    return sandbox.SandboxConfig(python=sandbox_python(), seconds=3.0, memory_mb=512)


@pytest.fixture(scope="module")
def environment(config):
    return terminal_environment(config)


@pytest.fixture(scope="module")
def quick_environment(config):
    """The environment with a 1 s command limit (its test's too), for the tests that wait one out."""
    return terminal_environment(dataclasses.replace(config, seconds=1.0))


def task_file(tmp_path, *records) -> str:
    path = tmp_path / "tasks.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def opened(environment, tmp_path, record=SORT_TASK):
    tasks = TerminalTasks(task_file(tmp_path, record), None)
    env = environment()
    assert env.reset(tasks.example(0)) == record["instruction"]
    return env


def bash(env, command: str) -> tuple[str, float, bool]:
    return env.step(f"<bash>{command}</bash>")


def test_files_outlive_a_turn_and_processes_and_the_directory_do_not(environment, tmp_path):
    env = opened(environment, tmp_path)
    assert bash(env, "mkdir d && echo kept > d/f && chmod +x d/f && cd d && pwd") == (
        "\n<output>/work/d\n</output>\n", 0.0, False)
    assert bash(env, "pwd; cat d/f; ls -l d/f | cut -c1-10") == (
        "\n<output>/work\nkept\n-rwxr-xr-x\n</output>\n", 0.0, False)
    bash(env, "(sleep 0.2; echo late > late) > /dev/null 2>&1 &")
    output, _, _ = bash(env, "ps -e -o comm= | grep -c sleep; cat late")
    assert output == "\n<output>0\nlate\n</output>\n"


def test_files_and_directories_the_command_made_unreadable_are_kept_with_their_modes(environment, tmp_path):
    """A chmod of the model's hides nothing from the keeper (it read no file and lost the turn, and
    a `chmod 000 .` lost every file); the files come back with the modes the command left."""
    env = opened(environment, tmp_path)
    assert bash(env, "mkdir d && echo x > d/f && chmod 000 ab d/f d .") == ("\n<output></output>\n", 0.0, False)
    assert bash(env, "ls -l ab d/f | cut -c1-10; chmod 600 ab d/f; cat ab d/f") == (
        "\n<output>----------\n----------\nb\nc\na\nx\n</output>\n", 0.0, False)


def test_a_command_killed_at_its_limit_leaves_the_files_as_they_were(environment, tmp_path):
    env = opened(environment, tmp_path)
    bash(env, "echo before > f")
    output, reward, done = bash(env, "echo after > f; sleep 20")
    assert "(killed: the command's limit of 3 s; the files are as they were)" in output
    assert (reward, done) == (0.0, False)
    assert bash(env, "cat f")[0] == "\n<output>before\n</output>\n"


def test_a_slow_sandbox_start_up_kills_no_command_and_fails_no_test(environment, tmp_path, slow_bubblewrap):
    """The limit counts from the command's start, inside the sandbox: a host whose start-up
    alone outlasts the limit still runs each command, and its test, to the end."""
    env = opened(environment, tmp_path)
    started = time.monotonic()
    assert bash(env, "sort ab > cd; echo sorted") == ("\n<output>sorted\n</output>\n", 0.0, False)
    assert time.monotonic() - started > 4
    assert env.finish() == 1.0
    output, _, _ = bash(env, "sleep 20")
    assert "(killed: the command's limit of 3 s; the files are as they were)" in output


def test_a_command_killed_at_its_limit_shows_none_of_its_output(quick_environment, tmp_path):
    """What a killed command had printed by its limit depends on timing: the model reads only how
    it ended, so a conversation's tokens do not follow the machine's load."""
    env = opened(quick_environment, tmp_path)
    assert bash(env, "echo partial; echo partial >&2; sleep 20") == (
        "\n<output>(killed: the command's limit of 1 s; the files are as they were)</output>\n", 0.0, False)


def test_a_command_killed_by_a_signal_is_told_so_and_keeps_its_files(environment, tmp_path):
    """A negative return code is the signal that killed the command, not an exit status."""
    env = opened(environment, tmp_path)
    assert bash(env, "echo shown; echo kept > f; kill -9 $$") == (
        "\n<output>shown\n(killed by signal 9)</output>\n", 0.0, False)
    assert bash(env, "cat f")[0] == "\n<output>kept\n</output>\n"


def test_a_command_that_stops_the_keeper_is_killed_at_the_hosts_bound(environment, tmp_path, monkeypatch):
    monkeypatch.setattr(sandbox, "KEEPER_START_SECONDS", 1.0)
    env = opened(environment, tmp_path)
    bash(env, "echo before > f")
    started = time.monotonic()
    output, _, _ = bash(env, "echo after > f; kill -STOP $PPID; sleep 20")
    assert 3 < time.monotonic() - started < 8
    assert "(killed: the command's limit of 3 s; the files are as they were)" in output
    assert bash(env, "cat f")[0] == "\n<output>before\n</output>\n"


def test_a_command_that_kills_the_keeper_loses_its_turn_only(environment, tmp_path):
    env = opened(environment, tmp_path)
    bash(env, "echo before > f")
    bash(env, "echo after > f; kill -9 $PPID")
    assert bash(env, "cat f")[0] == "\n<output>before\n</output>\n"


def test_the_keepers_answer_cannot_be_read_or_forged(environment, tmp_path):
    """The command runs as the keeper's user; the keeper is non-dumpable, so its /proc files (its
    stdout, the answer's channel) are closed to the command."""
    env = opened(environment, tmp_path)
    output, _, _ = bash(env, "ls /proc/$PPID/fd; readlink /proc/$PPID/fd/1 || echo unreadable; cat /proc/$PPID/environ")
    assert output.count("Permission denied") == 2 and "unreadable" in output, output
    forge = ("echo '{\"stdout\": \"forged\", \"stderr\": \"\", \"returncode\": 0, "
             "\"files\": {\"cd\": [\"YQpiCmMK\", 420]}}' > /proc/$PPID/fd/1")
    output, _, _ = bash(env, forge)
    assert "forged" not in output and "Permission denied" in output
    assert env.finish() == 0.0  # no sorted file was forged into the working directory


def test_a_turn_ends_when_every_process_the_command_started_has_ended(environment, tmp_path):
    """A background job, and a daemon its subshell left, finish before the turn's output and files
    are taken: were they killed at the shell's exit, what a conversation holds would depend on
    whether they had run by then (a tiny terminal run's tokens differed on a loaded host)."""
    env = opened(environment, tmp_path)
    command = "(sleep 0.5; sort ab > cd; echo job) & ( (sleep 0.5; echo daemon > d) & ); echo shell"
    assert bash(env, command) == ("\n<output>shell\njob\n</output>\n", 0.0, False)
    assert bash(env, "cat cd d")[0] == "\n<output>a\nb\nc\ndaemon\n</output>\n"


def test_a_process_still_running_at_the_limit_is_killed_with_the_command(environment, tmp_path):
    env = opened(environment, tmp_path)
    started = time.monotonic()
    output, _, _ = bash(env, "echo kept > f; sleep 30 &")
    assert 3 < time.monotonic() - started < 8
    assert output == "\n<output>(killed: the command's limit of 3 s; the files are as they were)</output>\n"
    output, _, _ = bash(env, "ps -e -o comm= | grep -c sleep; cat f")
    assert output.startswith("\n<output>0\n") and "No such file" in output


def test_the_tests_stay_hidden_until_scoring_and_score_the_files(environment, tmp_path):
    env = opened(environment, tmp_path)
    output, _, _ = bash(env, "ls -a; cat .tests/check.sh")
    assert output == "\n<output>.\n..\nab\ncat: .tests/check.sh: No such file or directory\n(exit 1)</output>\n"
    assert env.step("<done></done>") == ("", 0.0, True)
    env = opened(environment, tmp_path)
    bash(env, "sort ab > cd")
    assert env.step("<done></done>") == ("", 1.0, True)


def test_a_test_written_by_the_model_is_replaced_by_the_tasks(environment, tmp_path):
    env = opened(environment, tmp_path)
    bash(env, "mkdir .tests && echo 'exit 0' > .tests/check.sh")
    assert env.finish() == 0.0


def test_a_test_killed_at_its_limit_scores_zero(quick_environment, tmp_path):
    """The task is solved, but its test command does not finish within the limit (killed: no exit
    status): the reward is 0, never 1."""
    slow_check = {**SORT_TASK, "tests": {"check.sh": SORT_TASK["tests"]["check.sh"].strip() + " && sleep 20\n"}}
    env = opened(quick_environment, tmp_path, slow_check)
    bash(env, "sort ab > cd")
    assert env.step("<done></done>") == ("", 0.0, True)  # let run, the check passes: reward 1


def test_the_budget_ends_the_conversation_and_scores_it(environment, tmp_path):
    env = opened(environment, tmp_path, {**SORT_TASK, "seconds": 1})
    output, reward, done = bash(env, "sort ab > cd; sleep 5")
    assert "(killed: the task's budget of 1 s ran out;" in output and (reward, done) == (0.0, True)
    env = opened(environment, tmp_path, {**SORT_TASK, "seconds": 2})
    bash(env, "sleep 1.2")
    output, reward, done = bash(env, "sort ab > cd; sleep 2")  # under 0.8 s left: killed, the sort undone
    assert "(killed: the task's budget of 2 s ran out;" in output and done and reward == 0.0


def test_the_budget_charges_the_commands_own_time_not_a_busy_hosts(environment, tmp_path, monkeypatch):
    """A host that takes 1 s to start each sandbox (a loaded machine) charges the task nothing of
    it: with the whole call charged, a 1.5 s budget would run out at the second command and the
    conversation's tokens would follow the machine's load. A killed command is charged its limit."""
    env = opened(environment, tmp_path, {**SORT_TASK, "seconds": 1.5})
    slow_start = sandbox._run_isolated
    monkeypatch.setattr(sandbox, "_run_isolated", lambda *a: time.sleep(1.0) or slow_start(*a))
    assert bash(env, "true") == ("\n<output></output>\n", 0.0, False)
    assert bash(env, "sort ab > cd") == ("\n<output></output>\n", 0.0, False)
    assert 1.0 < env.seconds_left <= 1.5
    monkeypatch.setattr(sandbox, "_run_isolated", slow_start)
    left = env.seconds_left
    output, reward, done = bash(env, "sleep 5")
    assert "the task's budget of 1.5 s ran out" in output and done and reward == 1.0
    assert env.seconds_left == 0.0  # charged its limit, which was what was left


def test_a_turn_without_an_action_is_told_so(environment, tmp_path):
    env = opened(environment, tmp_path)
    observation, reward, done = env.step("ls")
    assert "<bash>command</bash> or <done></done>" in observation and (reward, done) == (0.0, False)
    # the command is what follows the turn's last <bash>: text before it is the model's, not the shell's
    assert env.step("let me try <bash> no, <bash>echo hi</bash>")[0] == "\n<output>hi\n</output>\n"


def test_a_conversation_cut_by_the_turn_limit_is_scored_by_finish():
    class Finishing:
        def __init__(self, score):
            self.score = score

        def finish(self):
            if self.score is None:
                raise RuntimeError("broken tests")
            return self.score

    cut = [conversations.Conversation(Finishing(score), scored_when_cut=True) for score in (1.0, 0.0, None, float("nan"))]
    over = conversations.Conversation(Finishing(1.0), over=True, scored_when_cut=True)
    no_finish = conversations.Conversation(object())
    counts = Counter()
    conversations._finish_cut([*cut, over, no_finish], EnvironmentCalls(seed=0, timeout_s=5, workers=None), counts)
    assert [(c.reward, c.problem) for c in cut] == [(1.0, None), (0.0, None), (0.0, "env_failures"),
                                                    (0.0, "env_failures")]
    assert (over.reward, no_finish.reward) == (0.0, 0.0) and not any(c.over for c in cut)


@pytest.mark.parametrize("change,error", [
    ({"instruction": ""}, "field 'instruction' must be a non-empty string"),
    ({"test": 3}, "field 'test' must be a non-empty string"),
    ({"files": {"../x": "a"}}, "field 'files': file '../x': expected a relative path"),
    ({"tests": {"/etc/x": "a"}}, "field 'tests': file '/etc/x': expected a relative path"),
    ({"files": {"a": 1}}, "field 'files' must be an object of path -> text"),
    ({"seconds": 0}, "field 'seconds' must be a number > 0"),
    ({"seconds": True}, "field 'seconds' must be a number > 0"),  # JSON true is not 1 second
    ({"solution": ""}, "field 'solution' must be a non-empty string"),
])
def test_a_bad_task_line_is_named(tmp_path, change, error):
    path = task_file(tmp_path, SORT_TASK, {**SORT_TASK, **change})
    with pytest.raises(ValueError, match=f"^{path}:2: {error}"):
        read_tasks(path)


def test_a_task_file_without_tasks_is_named(tmp_path):
    path = tmp_path / "tasks.jsonl"
    path.write_text("\n  \n")
    with pytest.raises(ValueError, match=f"^{path}: no tasks$"):
        read_tasks(str(path))


def test_the_warm_up_needs_every_solution_and_shows_its_real_output(config, tmp_path):
    no_solution = {k: v for k, v in SORT_TASK.items() if k != "solution"}
    path = task_file(tmp_path, SORT_TASK, no_solution)
    with pytest.raises(ValueError, match=f"^{path}:2: field 'solution' is needed for the SFT warm-up"):
        TerminalTasks(path, config, demonstrations=True)
    assert TerminalTasks(path, config).example(1).demonstration is None  # RL alone: no solution needed
    listing = {**SORT_TASK, "solution": "cat ab; ls"}
    example = TerminalTasks(task_file(tmp_path, listing), config, demonstrations=True).example(0)
    assert example.demonstration == ("<bash>cat ab; ls</bash>", "\n<output>b\nc\na\nab\n</output>\n", "<done></done>")


def test_build_task_with_the_warm_up_gives_demonstrations_and_needs_every_solution(config, tmp_path):
    """build_task's `warmup` (--rl-sft-warmup-steps > 0) reaches the terminal's tasks: each example
    carries its solution's demonstration, and a line without a solution is refused."""
    path = task_file(tmp_path, SORT_TASK)
    example = build_task("terminal", 0, path, "terminal", config, warmup=True).example(0)
    assert example.demonstration == ("<bash>sort ab > cd</bash>", "\n<output></output>\n", "<done></done>")
    assert build_task("terminal", 0, path, "terminal", config).example(0).demonstration is None
    no_solution = {k: v for k, v in SORT_TASK.items() if k != "solution"}
    path = task_file(tmp_path, SORT_TASK, no_solution)
    with pytest.raises(ValueError, match=f"^{path}:2: field 'solution' is needed for the SFT warm-up"):
        build_task("terminal", 0, path, "terminal", config, warmup=True)


def test_every_shipped_task_is_solved_by_its_solution_and_not_by_nothing(environment, config):
    tasks = build_task("terminal", 0, str(SHIPPED), "terminal", config)
    assert tasks.size == 48
    for index in range(tasks.size):
        example = tasks.example(index)
        env = environment()
        env.reset(example)
        assert env.finish() == 0.0, example.prompt
        bash(env, example.answer)
        assert env.step("<done></done>") == ("", 1.0, True), example.prompt


def test_the_shipped_tasks_are_the_generators(tmp_path):
    written = tmp_path / "tasks.jsonl"
    subprocess.run([sys.executable, str(REPO / "tools" / "terminal_tasks.py"), "--count", "48", "--seed", "0",
                    "--output", str(written)], check=True, capture_output=True)
    assert written.read_text() == SHIPPED.read_text()


def test_build_environment_names_terminal_and_refuses_no_isolation(config, monkeypatch):
    assert build_environment("terminal", None, code_sandbox=config).sandbox_config.shell
    with pytest.raises(ValueError, match="--rl-code-without-isolation: --rl-env terminal has no unisolated mode"):
        terminal_environment(sandbox.SandboxConfig(python=config.python, isolated=False))
    monkeypatch.setattr(sandbox, "BUBBLEWRAP", "no-such-bwrap")
    sandbox.check.cache_clear()
    try:
        with pytest.raises(ValueError, match="--rl-env terminal: the sandbox cannot isolate commands here"):
            terminal_environment(config)
    finally:
        sandbox.check.cache_clear()


def test_keeping_files_is_isolated_only(config):
    with pytest.raises(ValueError, match="isolated only"):
        sandbox.run_keeping_files(sandbox.SandboxConfig(python=config.python, isolated=False), ["/bin/true"], {})


def test_a_terminal_reaches_no_host_file(environment, tmp_path):
    secret = tmp_path / "secret"
    secret.write_text("host")
    env = opened(environment, tmp_path)
    output, _, _ = bash(env, f"cat {secret}; ls /root /home /etc 2>&1 | head -3; touch /usr/bin/x")
    assert "host" not in output and "No such file" in output and "Read-only file system" in output
    assert not os.path.exists("/usr/bin/x")


def test_a_command_runs_under_the_sandboxs_limits(environment, tmp_path):
    env = opened(environment, tmp_path)
    # address space 512 MiB (KiB), file size 16 MiB (512-byte blocks), 64 open files, CPU 3 s
    assert bash(env, "ulimit -v; ulimit -f; ulimit -n; ulimit -t")[0] == "\n<output>524288\n32768\n64\n3\n</output>\n"
