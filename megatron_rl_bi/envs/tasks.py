"""Built-in tasks (letter sorting, countdown) and JSONL prompt datasets, as index-addressed
example streams. A `PromptSource` walks a task in a seeded order, one shard per data-parallel
rank, and its position is part of the RL checkpoint.
"""

import functools
import math
import random
import string
from collections.abc import Callable
from dataclasses import dataclass

from megatron_rl_bi.envs.search import information
from megatron_rl_bi.envs.terminal import TerminalTask, observation, read_tasks, solution_output, terminal_environment
from megatron_rl_bi.envs.verifiers import verify_countdown, verify_exact_match, verify_math, verify_sort
from megatron_rl_bi.jsonfile import parse_object


@dataclass(frozen=True)
class Example:
    prompt: str
    answer: str
    """A reference completion (the SFT warm-up target), not necessarily the only right one."""
    verify: Callable[[str], float] | None
    """completion text -> reward (None: an environment scores it, --rl-env)."""
    demonstration: tuple[str, ...] | None = None
    """The SFT warm-up target when it is more than `answer`: a multi-turn task's conversation,
    the model's turns and the environment's answers alternating (the model's first); the warm-up
    learns the model's turns only, as RL does."""
    accepted: tuple[str, ...] = ()
    """Every answer that scores (a QA line's golden answers); empty: `answer` alone."""
    terminal: TerminalTask | None = None
    """A terminal task's files, tests and budget (--rl-env terminal)."""


class SortTask:
    """'sort: dcab\\n' -> 'abcd'. Distinct lowercase letters, length in [min_letters, max_letters]."""

    def __init__(self, seed: int, min_letters: int = 3, max_letters: int = 6):
        self.seed, self.min_letters, self.max_letters = seed, min_letters, max_letters
        self.size = None

    def example(self, index: int) -> Example:
        rng = random.Random(f"sort-{self.seed}-{index}")
        letters = rng.sample(string.ascii_lowercase, rng.randint(self.min_letters, self.max_letters))
        answer = "".join(sorted(letters))
        return Example(
            prompt=f"sort: {''.join(letters)}\n",
            answer=answer,
            verify=functools.partial(verify_sort, answer=answer),
        )


class CountdownTask:
    """'countdown: 3 5 7 -> 22\\n' -> an expression using 3, 5 and 7 once each that equals 22.
    With `code_demonstrations` (--rl-env code) the warm-up's target is a conversation with the
    code environment: print the expression, read its value, answer with it."""

    def __init__(self, seed: int, num_numbers: int = 3, max_number: int = 9, code_demonstrations: bool = False):
        self.seed, self.num_numbers, self.max_number = seed, num_numbers, max_number
        self.code_demonstrations = code_demonstrations
        self.size = None

    def example(self, index: int) -> Example:
        rng = random.Random(f"countdown-{self.seed}-{index}")
        numbers = [rng.randint(1, self.max_number) for _ in range(self.num_numbers)]
        expression = str(numbers[0])
        for number in numbers[1:]:
            expression = f"{expression}{rng.choice('+-*')}{number}"
        target = eval(expression)  # only digits and + - * built just above
        return Example(
            prompt=f"countdown: {' '.join(map(str, numbers))} -> {target}\n",
            answer=expression,
            verify=functools.partial(verify_countdown, numbers=numbers, target=target),
            # with the code environment's answer to the first turn (envs.code): the program's output
            demonstration=((f"<code>print({expression})</code>", f"\n<output>{target}\n</output>\n",
                            f"<answer>{expression}</answer>") if self.code_demonstrations else None),
        )


class LookupTask:
    """'find b4x\n' -> the value of key b4x, which only the task's corpus holds ('b4x is 317'): the
    model must search for the key (--rl-env search) and copy the value it reads. Keys mix letters
    and a digit (never an English stop word the retriever drops); `corpus_size` keys, seeded:
    thousands, so a tiny model cannot learn the values by heart in a warm-up (with 64 it did, and
    then needed no search)."""

    def __init__(self, seed: int, corpus_size: int = 4096):
        rng = random.Random(f"lookup-{seed}")
        keys = set()
        while len(keys) < corpus_size:
            keys.add(rng.choice(string.ascii_lowercase) + rng.choice(string.digits) + rng.choice(string.ascii_lowercase))
        self.seed, self.keys = seed, sorted(keys)
        self.values = {key: str(rng.randint(100, 999)) for key in self.keys}
        self.corpus = [f"{key} is {self.values[key]}" for key in self.keys]
        self.size = None

    def example(self, index: int) -> Example:
        key = random.Random(f"lookup-{self.seed}-{index}").choice(self.keys)
        value = self.values[key]
        return Example(
            prompt=f"find {key}\n",
            answer=value,
            verify=None,
            demonstration=(f"<search>{key}</search>", information([f"{key} is {value}"]), f"<answer>{value}</answer>"),
        )


class JsonlTask:
    """One JSON object per line, UTF-8, with fields 'prompt' (a string) and 'answer' (a string or
    a JSON number), math verifier; or a QA line as NQ / HotpotQA / Search-R1 publish them,
    'question' and 'golden_answers' (or 'answer'), exact match. Every line is checked when the
    file is opened: a bad line fails with FILE:LINE."""

    def __init__(self, path: str):
        self.path, self.examples, self.line_numbers = path, [], []
        for line_number, line in _utf8_lines(path):
            if not line.strip():
                continue
            self.examples.append(_parse_line(path, line_number, line))
            self.line_numbers.append(line_number)
        if not self.examples:
            raise ValueError(f"{path}: no examples")
        self.size = len(self.examples)

    def example(self, index: int) -> Example:
        return self.examples[index]

    def check_prompts(self, encode_prompt, max_tokens: int) -> None:
        """Every prompt encodes (`encode_prompt`, as the rollouts encode it) to at most
        `max_tokens` tokens; otherwise one error naming FILE:LINE, before any GPU work."""
        for line_number, example in zip(self.line_numbers, self.examples):
            _check_prompt(f"{self.path}:{line_number}", example.prompt, encode_prompt, max_tokens)


class TerminalTasks:
    """The tasks of a terminal task file (envs.terminal's layout), each prompted with its
    instruction as it is. With `demonstrations` (an SFT warm-up) every line needs a 'solution':
    the warm-up's target is that command, its output (run once in the sandbox) and done."""

    def __init__(self, path: str, sandbox_config, demonstrations: bool = False):
        self.path, self.lines = path, read_tasks(path)
        self.size, self.demonstrations = len(self.lines), demonstrations
        if demonstrations:
            self.environment = terminal_environment(sandbox_config)
            if missing := [line for line, task in self.lines if task.solution is None]:
                raise ValueError(f"{path}:{missing[0]}: field 'solution' is needed for the SFT warm-up "
                                 "(--rl-sft-warmup-steps)")
        self._outputs = {}

    def example(self, index: int) -> Example:
        _, task = self.lines[index]
        demonstration = None
        if self.demonstrations:
            if index not in self._outputs:
                self._outputs[index] = solution_output(task, self.environment)
            demonstration = (f"<bash>{task.solution}</bash>", observation(self._outputs[index]), "<done></done>")
        return Example(prompt=task.instruction, answer=task.solution or "", verify=None,
                       demonstration=demonstration, terminal=task)

    def check_prompts(self, encode_prompt, max_tokens: int) -> None:
        """As JsonlTask.check_prompts: every instruction fits the engine, else FILE:LINE."""
        for line_number, task in self.lines:
            _check_prompt(f"{self.path}:{line_number}", task.instruction, encode_prompt, max_tokens)


def _check_prompt(where: str, prompt: str, encode_prompt, max_tokens: int) -> None:
    try:
        length = len(encode_prompt(prompt))
    except ValueError as exc:
        raise ValueError(f"{where}: the prompt cannot be tokenized ({exc})") from None
    if length > max_tokens:
        raise ValueError(f"{where}: the prompt is {length} tokens; the engine takes at most "
                         f"{max_tokens} (raise --inference-max-seq-length and "
                         "--inference-dynamic-batching-max-tokens)")


def _utf8_lines(path: str):
    """(line number, text) for each line of `path`; a line that is not UTF-8 fails with FILE:LINE."""
    with open(path, "rb") as f:  # decoded line by line, so that an error knows its line
        for line_number, raw_line in enumerate(f, start=1):
            try:
                yield line_number, raw_line.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise ValueError(f"{path}:{line_number}: not UTF-8 ({exc.reason} at byte "
                                 f"{exc.start + 1} of the line)") from None


def _answer_text(value) -> str | None:
    """A record's answer as text: a non-empty string, or a finite JSON number as Python writes it
    (3, -0.5, 1e+21: the math verifier compares numbers exactly); None for anything else."""
    if isinstance(value, str):
        return value or None
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    if isinstance(value, float) and math.isfinite(value):  # json reads NaN and Infinity too
        return str(value)
    return None


# A question line's prompt (NQ / HotpotQA / Search-R1 files give the question alone).
QUESTION_PROMPT = ("Answer the question. Think it through; to look something up, write "
                   "<search>query</search>, and the results come back between <information> and "
                   "</information>. Give the final answer as <answer>...</answer>.\nQuestion: {}\n")


def _parse_line(path: str, line_number: int, line: str) -> Example:
    where = f"{path}:{line_number}"
    record = parse_object(line, path, line_number)
    if "question" in record and "prompt" not in record:
        return _question_line(where, record)
    if not isinstance(record.get("prompt"), str) or not record["prompt"]:
        raise ValueError(f"{where}: field 'prompt' must be a non-empty string")
    answer = _answer_text(record.get("answer"))
    if answer is None:
        raise ValueError(f"{where}: field 'answer' must be a non-empty string or a finite number")
    return Example(
        prompt=record["prompt"],
        answer=answer,
        verify=functools.partial(verify_math, answer=answer),
    )


def _question_line(where: str, record: dict) -> Example:
    """A QA line as published: 'question' and its answers ('golden_answers' or 'answer', a string
    or a list), scored by exact match against any of them."""
    question = record["question"]
    answers = record.get("golden_answers", record.get("answer"))
    answers = [answers] if isinstance(answers, str) else answers
    if not isinstance(question, str) or not question:
        raise ValueError(f"{where}: field 'question' must be a non-empty string")
    if not isinstance(answers, list) or not answers or not all(isinstance(a, str) and a for a in answers):
        raise ValueError(f"{where}: field 'golden_answers' (or 'answer') must be a non-empty string or list of them")
    return Example(prompt=QUESTION_PROMPT.format(question), answer=answers[0], accepted=tuple(answers),
                   verify=functools.partial(verify_exact_match, answers=tuple(answers)))


def build_task(name: str, seed: int, dataset: str | None = None, environment: str | None = None,
               sandbox_config=None, warmup: bool = False):
    """--rl-task sort|countdown|lookup|jsonl|terminal (jsonl and terminal need --rl-dataset FILE);
    `environment` is --rl-env (countdown's warm-up then shows a conversation with the code
    environment); a terminal task's warm-up (`warmup`) runs its solutions in `sandbox_config`."""
    if name == "sort":
        return SortTask(seed)
    if name == "countdown":
        return CountdownTask(seed, code_demonstrations=environment == "code")
    if name == "lookup":
        return LookupTask(seed)
    if name == "jsonl":
        if not dataset:
            raise ValueError("--rl-task jsonl needs --rl-dataset FILE")
        return JsonlTask(dataset)
    if name == "terminal":
        if not dataset:
            raise ValueError("--rl-task terminal needs --rl-dataset FILE (tasks: envs/terminal.py's layout)")
        return TerminalTasks(dataset, sandbox_config, demonstrations=warmup)
    raise ValueError(f"--rl-task {name}: expected sort, countdown, lookup, jsonl or terminal")


class PromptSource:
    """Examples for one data-parallel rank: global index = position * world + rank.
    Finite datasets are walked in a seeded shuffle, reshuffled each epoch."""

    def __init__(self, task, seed: int, rank: int = 0, world_size: int = 1):
        self.task, self.seed, self.rank, self.world_size = task, seed, rank, world_size
        self.position = 0

    def _global_example(self, index: int) -> Example:
        if self.task.size is None:
            return self.task.example(index)
        epoch, offset = divmod(index, self.task.size)
        order = list(range(self.task.size))
        random.Random(f"epoch-{self.seed}-{epoch}").shuffle(order)
        return self.task.example(order[offset])

    def take(self, count: int) -> list[Example]:
        start = self.position
        self.position += count
        return [
            self._global_example(i * self.world_size + self.rank)
            for i in range(start, start + count)
        ]

    def state_dict(self) -> dict:
        return {"position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.position = int(state["position"])
