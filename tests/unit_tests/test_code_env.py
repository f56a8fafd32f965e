"""The built-in code environment (--rl-env code), on CPU: a program runs in the sandbox
(envs.sandbox; its escape suite is test_sandbox.py) and its output comes back, said so when a
limit stopped it; a conversation computes, reads the output and is scored by the task's verifier."""

import os
import sys
import time
from types import SimpleNamespace

import pytest

from megatron_rl_bi.config import parse_rl_args
from megatron_rl_bi.config.from_args import code_sandbox_from_args
from megatron_rl_bi.envs import build_task
from megatron_rl_bi.envs.code import OUTPUT_CHARACTERS, code_environment, run_python
from megatron_rl_bi.envs.sandbox import SandboxConfig, base_interpreter
from megatron_rl_bi.envs.environment import build_environment
from megatron_rl_bi.envs.tokenizer import CharTokenizer
from megatron_rl_bi.inference import Generation, Sampling
from megatron_rl_bi.rl.conversations import TurnConfig, run_conversations

from ..sandbox_fixtures import sandbox_python
from .conftest import ScriptedGenerator
from .test_search_env import COMMON


@pytest.fixture(scope="module")
def limits():
    python = sandbox_python()
    return lambda seconds=5.0, memory_mb=512: SandboxConfig(python=python, seconds=seconds, memory_mb=memory_mb)


def test_a_program_runs_in_its_own_directory(limits):
    assert run_python("print(6 * 7)", limits()) == "42\n"
    output = run_python("open('notes.txt', 'w').write('hi')\nimport json, os\nprint(open('notes.txt').read(), "
                        "sorted(os.listdir('.')), json.dumps([1]), os.getcwd())", limits())
    assert output == "hi ['main.py', 'notes.txt'] [1] /work\n"


def test_the_output_says_which_limit_stopped_the_program(limits):
    started = time.monotonic()
    assert run_python("import time\nprint('a', flush=True)\ntime.sleep(30)", limits(1.5)) == "a\n\n(killed after 1.5 s)"
    assert time.monotonic() - started < 5
    assert run_python("import os\nprint('b', flush=True)\nos.kill(os.getpid(), 9)", limits()) == (
        "b\n\n(killed by signal 9: a limit)")
    assert "MemoryError" in run_python("x = bytearray(2 * 1024**3)", limits(memory_mb=256))
    assert run_python("import sys\nprint('x' * 100000)\nprint('y', file=sys.stderr)", limits()) == "x" * OUTPUT_CHARACTERS
    assert run_python("import sys\nprint('x')\nsys.exit('no')", limits()) == "x\nno\n"


class ComputesThenAnswers(ScriptedGenerator):
    """Writes countdown's arithmetic as a program, reads the output, answers with the expression."""

    config = SimpleNamespace(max_sequence_length=512, max_prompt_tokens=511)

    def __init__(self, tokenizer):
        self.tok = tokenizer

    def generate(self, prompts, sampling, max_new_tokens=None):
        out = []
        for prompt in prompts:
            text = self.tok.decode(prompt)
            numbers = text.split(": ")[1].split(" ->")[0].split()
            expression = "+".join(numbers)
            turn = f"<code>print({expression})</code>" if "<output>" not in text else f"<answer>{expression}</answer>"
            ids = self.tok.encode(turn)
            out.append(Generation(prompt_tokens=list(prompt), completion_tokens=ids, completion_logprobs=[-1.0] * len(ids)))
        return out


def test_a_conversation_runs_code_and_is_scored_by_the_tasks_verifier(limits):
    tok, task = CharTokenizer(), build_task("countdown", seed=0)
    examples = [task.example(i) for i in range(4)]
    environment = build_environment("code", task, code_sandbox=limits())
    generations, scores, counts = run_conversations(ComputesThenAnswers(tok), examples, environment, tok,
                                                    Sampling(max_new_tokens=64), TurnConfig(max_turns=3))
    first = tok.decode(generations[0].completion_tokens)
    numbers = examples[0].prompt.split(": ")[1].split(" ->")[0].split()
    assert first.startswith(f"<code>print({'+'.join(numbers)})</code>\n<output>{sum(map(int, numbers))}\n</output>\n")
    # the sum of the numbers is right only where the target is that sum
    assert [s for s, _ in scores] == [examples[i].verify("+".join(numbers_of(examples[i]))) for i in range(4)]
    assert counts["turns"] == 8 and not counts["env_failures"]


def numbers_of(example):
    return example.prompt.split(": ")[1].split(" ->")[0].split()


def test_code_environment_runs_programs_with_its_sandbox(limits):
    environment = code_environment(limits(2.5, 300))
    assert environment.sandbox_config == limits(2.5, 300) and environment.stop_strings == ("</code>", "</answer>")


def test_a_turn_without_code_or_answer_is_told_so_and_the_conversation_goes_on(limits):
    environment = code_environment(limits(2.5, 300))()
    environment.reset(build_task("countdown", seed=0).example(0))
    assert environment.step("I think the answer is 7") == (
        "\nThe last turn took no action. Write one of: <code>program</code> or <answer>answer</answer>.\n",
        0.0, False)


@pytest.mark.parametrize("flag,error", [
    (["--rl-code-python", "/usr/bin/python3"], "--rl-code-python is read by --rl-env code or terminal only"),
    (["--rl-code-without-isolation"], "--rl-code-without-isolation is read by --rl-env code only"),
    (["--rl-env", "terminal", "--rl-task", "terminal", "--rl-dataset", "t.jsonl", "--rl-code-without-isolation"],
     r"--rl-code-without-isolation is read by --rl-env code only \(a terminal has no unisolated mode\)"),
    (["--rl-env", "terminal"], "--rl-task terminal and --rl-env terminal go together"),
    (["--rl-task", "terminal", "--rl-dataset", "t.jsonl"], "--rl-task terminal and --rl-env terminal go together"),
])
def test_sandbox_flags_without_their_environment_are_refused(flag, error):
    with pytest.raises(ValueError, match=error):
        parse_rl_args(COMMON + flag)


def test_the_flags_make_the_sandbox(tmp_path):
    python = tmp_path / "python3"
    python.symlink_to(sys.executable)
    args = parse_rl_args(COMMON + ["--rl-env", "code", "--rl-code-python", str(python), "--rl-code-time-limit", "2",
                                   "--rl-code-memory-mb", "300"])
    assert code_sandbox_from_args(args) == SandboxConfig(python=os.path.realpath(sys.executable), seconds=2.0,
                                                         memory_mb=300)
    args = parse_rl_args(COMMON + ["--rl-env", "code", "--rl-code-without-isolation"])
    assert code_sandbox_from_args(args) == SandboxConfig(python=base_interpreter(), isolated=False)


def test_countdowns_warm_up_conversation_is_the_one_the_environment_holds(limits):
    """--rl-task countdown --rl-env code: the demonstration's middle piece is what the sandbox
    answers to its first turn, and its answer scores."""
    task = build_task("countdown", seed=0, environment="code")
    environment = code_environment(limits())()
    for index in range(3):
        example = task.example(index)
        code_turn, observation, answer_turn = example.demonstration
        assert code_turn == f"<code>print({example.answer})</code>"
        environment.reset(example)
        assert environment.step(code_turn) == (observation, 0.0, False)
        assert environment.step(answer_turn) == ("", 1.0, True)
    assert build_task("countdown", seed=0).example(0).demonstration is None
