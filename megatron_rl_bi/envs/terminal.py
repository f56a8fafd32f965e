"""The built-in terminal environment (`--rl-env terminal`): each sample a task (an instruction,
the files it starts with, a test command, a time budget) whose files sit in the sandbox's working
directory; the model's turns are shell commands, `<bash>command</bash>`, each run by `/bin/sh` in
the OS-isolated sandbox (envs.sandbox, the code environment's: no network, no host files), its
output coming back as `<output>...</output>`. Files outlive a turn; processes, the working
directory and shell variables do not (each command is a fresh `sh -c` in `/work`; its turn
ends when it and every process it started have ended). A command killed at
--rl-code-time-limit, background jobs and all, leaves the files as they were before it.

The conversation ends when the model writes `<done></done>`, at the turn or context limit
(`finish`), or once its commands have used the task's budget of seconds; then the task's tests
are copied into `.tests/` (the model never sees them before) and its test command runs there,
in the sandbox: reward 1 when it exits 0, else 0. The budget counts the seconds the task's
commands run, not generation's: BI's slower generation does not eat it, and a run stays
reproducible.

Tasks are JSONL (`--rl-task terminal --rl-dataset FILE`), one a line:
  {"instruction": "...", "files": {"notes.txt": "..."}, "tests": {"check.sh": "..."},
   "test": "sh .tests/check.sh", "solution": "sort notes.txt > sorted.txt", "seconds": 20}
`files` and `tests` are optional (path -> text), `seconds` defaults to DEFAULT_SECONDS;
`solution`, a reference command, is the SFT warm-up's target (its output, run in the sandbox,
the demonstration's observation).
"""

import dataclasses
from dataclasses import dataclass, field

from megatron_rl_bi.envs import sandbox
from megatron_rl_bi.envs.actions import no_action_observation
from megatron_rl_bi.jsonfile import parse_object

DEFAULT_SECONDS = 30.0
TESTS = ".tests"
ACTIONS = ("<bash>command</bash>", "<done></done>")
# A command as a function schema, for --rl-tool-format chat (envs.tool_format).
BASH_TOOL = {"type": "function", "function": {
    "name": "bash", "description": "Run a shell command in the task's working directory; its output "
                                   "(stdout, then stderr) comes back.",
    "parameters": {"type": "object", "required": ["command"],
                   "properties": {"command": {"type": "string", "description": "the command line"}}}}}


@dataclass(frozen=True)
class TerminalTask:
    instruction: str
    test: str
    files: dict = field(default_factory=dict)
    tests: dict = field(default_factory=dict)
    solution: str | None = None
    seconds: float = DEFAULT_SECONDS


def command_output(result: sandbox.Result, limit: str) -> str:
    """What the model reads of a command: its output, and how it ended when not by exiting 0
    (`limit`: what killed it at its time, in words that do not depend on timings, which would
    make a conversation's tokens depend on them)."""
    if result.returncode is None:
        return f"{result.stdout}{result.stderr}(killed: {limit}; the files are as they were)"
    ending = "" if result.returncode == 0 else (
        f"(exit {result.returncode})" if result.returncode > 0 else f"(killed by signal {-result.returncode})")
    return f"{result.stdout}{result.stderr}{ending}"


def observation(output: str) -> str:
    return f"\n<output>{output}</output>\n"


class TerminalEnvironment:
    """One sample's conversation; the sandbox's settings come from `terminal_environment`."""

    sandbox_config = sandbox.SandboxConfig(shell=True)
    stop_strings = ("</bash>", "</done>")
    tools = (BASH_TOOL,)

    def reset(self, example) -> str:
        self.start(example.terminal)
        return example.prompt

    def start(self, task: TerminalTask) -> None:
        """The task's files in place, its whole budget left."""
        self.task, self.files, self.seconds_left = task, dict(task.files), task.seconds

    def step(self, text: str) -> tuple[str, float, bool]:
        if text.endswith("</bash>"):
            command = text.rsplit("<bash>", 1)[-1].removesuffix("</bash>")
            answer = observation(self.run(command))
            if self.seconds_left <= 0:
                return answer, self.finish(), True
            return answer, 0.0, False
        if text.endswith("</done>"):
            return "", self.finish(), True
        return no_action_observation(ACTIONS), 0.0, False

    def run(self, command: str) -> str:
        """The command's output; its files kept, its seconds taken from the budget."""
        limit = f"the command's limit of {self.sandbox_config.seconds:g} s"
        if self.seconds_left < self.sandbox_config.seconds:
            limit = f"the task's budget of {self.task.seconds:g} s ran out"
        config = dataclasses.replace(self.sandbox_config, seconds=max(min(self.sandbox_config.seconds,
                                                                          self.seconds_left), 0.1))
        result, files = sandbox.run_keeping_files(config, ["/bin/sh", "-c", command], self.files)
        # the command's own time, measured in the sandbox; one that sent nothing back, its limit:
        # the host's whole call would charge a busy machine's sandbox start-ups to the task
        self.seconds_left -= config.seconds if files is None else result.seconds
        if files is not None:
            self.files = files
        return command_output(result, limit)

    def finish(self) -> float:
        """The task's score: its test command, with its tests in TESTS, over the files as the
        model left them."""
        tests = {f"{TESTS}/{path}": text for path, text in self.task.tests.items()}
        # under the keeper, whose limit counts from the test's start, so a busy host's sandbox
        # start-up cannot fail it
        result, _ = sandbox.run_keeping_files(self.sandbox_config, ["/bin/sh", "-c", self.task.test],
                                              {**self.files, **tests})
        return 1.0 if result.returncode == 0 else 0.0


def terminal_environment(config: sandbox.SandboxConfig) -> type:
    """The environment class whose commands run with `config` (and the system's shell); refused
    (a ValueError naming the flag) when the sandbox cannot isolate commands here: a terminal has
    no unisolated mode."""
    config = dataclasses.replace(config, shell=True)
    if not config.isolated:
        raise ValueError("--rl-code-without-isolation: --rl-env terminal has no unisolated mode "
                         "(shell commands run only in the sandbox)")
    try:
        sandbox.check(config.python)
        result, _ = sandbox.run_keeping_files(config, ["/bin/sh", "-c", "echo isolated"], {})
    except sandbox.SandboxUnavailable as exc:
        raise ValueError(f"--rl-env terminal: the sandbox cannot isolate commands here: {exc}. Name another "
                         "interpreter with --rl-code-python PATH") from None
    if result.stdout != "isolated\n":
        raise ValueError(f"--rl-env terminal: the sandbox cannot run /bin/sh ({result.stderr.strip()[:300]})")
    return type("TerminalEnvironment", (TerminalEnvironment,), {"sandbox_config": config})


def read_tasks(path: str) -> list[tuple[int, TerminalTask]]:
    """(line number, task) of every line of a task file; a bad line fails with FILE:LINE."""
    tasks = []
    with open(path, encoding="utf-8") as f:
        for line_number, line in enumerate(f, start=1):
            if line.strip():
                tasks.append((line_number, _task(parse_object(line, path, line_number), f"{path}:{line_number}")))
    if not tasks:
        raise ValueError(f"{path}: no tasks")
    return tasks


def _task(record: dict, where: str) -> TerminalTask:
    for name in ("instruction", "test"):
        if not isinstance(record.get(name), str) or not record[name].strip():
            raise ValueError(f"{where}: field '{name}' must be a non-empty string")
    for name in ("files", "tests"):
        files = record.get(name, {})
        if not isinstance(files, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in files.items()):
            raise ValueError(f"{where}: field '{name}' must be an object of path -> text")
        for path in files:
            try:
                sandbox.check_path(path)
            except ValueError as exc:
                raise ValueError(f"{where}: field '{name}': {exc}") from None
    solution = record.get("solution")
    if solution is not None and (not isinstance(solution, str) or not solution.strip()):
        raise ValueError(f"{where}: field 'solution' must be a non-empty string")
    seconds = record.get("seconds", DEFAULT_SECONDS)
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not seconds > 0:
        raise ValueError(f"{where}: field 'seconds' must be a number > 0")
    return TerminalTask(record["instruction"], record["test"], dict(record.get("files", {})),
                        dict(record.get("tests", {})), solution, float(seconds))


def solution_output(task: TerminalTask, environment_class: type) -> str:
    """What the model reads after the task's solution, run in the sandbox as a turn is."""
    environment = environment_class()
    environment.start(task)
    return environment.run(task.solution)
