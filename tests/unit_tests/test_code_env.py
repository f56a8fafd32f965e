"""The built-in code environment (--rl-env code), on CPU: the sandbox runs a program and returns
its output, refuses the network, processes, ctypes and files outside its directory (reads of the
Python installation stay allowed, for imports), is stopped at its CPU, wall-clock and memory
limits; a conversation computes, reads the output and is scored by the task's verifier."""

import time
from types import SimpleNamespace

import pytest

from megatron_rl_bi.envs import build_task
from megatron_rl_bi.envs.code import OUTPUT_CHARACTERS, code_environment, run_python
from megatron_rl_bi.envs.environment import build_environment
from megatron_rl_bi.envs.tokenizer import CharTokenizer
from megatron_rl_bi.inference import Generation, Sampling
from megatron_rl_bi.rl.conversations import TurnConfig, run_conversations

from .conftest import ScriptedGenerator


def test_a_program_runs_in_its_own_directory():
    assert run_python("print(6 * 7)", 5, 512) == "42\n"
    output = run_python("open('notes.txt', 'w').write('hi')\nimport json, os\nprint(open('notes.txt').read(), "
                        "sorted(os.listdir('.')), json.dumps([1]))", 5, 512)
    assert output == "hi ['main.py', 'notes.txt'] [1]\n"


@pytest.mark.parametrize("program,refused", [
    ("import socket\nsocket.socket().connect(('127.0.0.1', 9))", "socket.connect is not allowed"),
    ("import urllib.request\nurllib.request.urlopen('http://example.com')", "socket.getaddrinfo is not allowed"),
    ("import subprocess\nsubprocess.run(['ls'])", "subprocess.Popen is not allowed"),
    ("import os\nos.system('ls')", "os.system is not allowed"),
    ("import ctypes\nctypes.CDLL(None)", "ctypes.dlopen is not allowed"),
    ("print(open('/etc/passwd').read())", "/etc/passwd is outside its directory"),
    ("open('../escape.txt', 'w')", "escape.txt is outside its directory"),
    ("import os\nprint(os.listdir('/'))", "sandbox: / is outside its directory"),
])
def test_the_sandbox_refuses(program, refused):
    output = run_python(program, 5, 512)
    assert "PermissionError" in output or "URLError" in output
    assert refused in output


def test_the_sandbox_stops_at_its_limits():
    started = time.monotonic()
    assert run_python("while True: pass", 1.5, 512).endswith("(killed by signal 9: a limit)")  # CPU time, 1 s
    assert run_python("import time\nprint('a', flush=True)\ntime.sleep(30)", 1.5, 512) == "a\n\n(killed after 1.5 s)"
    assert time.monotonic() - started < 10
    assert "MemoryError" in run_python("x = bytearray(2 * 1024**3)", 5, 256)
    assert len(run_python("print('x' * 100000)", 5, 512)) == OUTPUT_CHARACTERS


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


def test_a_conversation_runs_code_and_is_scored_by_the_tasks_verifier():
    tok, task = CharTokenizer(), build_task("countdown", seed=0)
    examples = [task.example(i) for i in range(4)]
    environment = build_environment("code", task, code_seconds=5, code_memory_mb=512)
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


def test_code_environment_limits_are_its_class_attributes():
    environment = code_environment(2.5, 300)
    assert (environment.seconds, environment.memory_mb, environment.stop_strings) == (2.5, 300, ("</code>", "</answer>"))


def test_a_turn_without_code_or_answer_is_told_so_and_the_conversation_goes_on():
    environment = code_environment(2.5, 300)()
    environment.reset(build_task("countdown", seed=0).example(0))
    assert environment.step("I think the answer is 7") == (
        "\nThe last turn took no action. Write one of: <code>program</code> or <answer>answer</answer>.\n",
        0.0, False)
