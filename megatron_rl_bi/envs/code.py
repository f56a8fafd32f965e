"""The built-in code environment (`--rl-env code`): the model may run Python before it answers.
`<code>...</code>` runs in the sandbox (envs.sandbox: bubblewrap's namespaces, no network, no
host files, the limits of --rl-code-time-limit and --rl-code-memory-mb) and its output comes
back as `<output>...</output>`; `<answer>...</answer>` ends the conversation, scored by the task's
own verifier (countdown's, the math verifier of a JSONL task, ...); a turn with neither is told
so and the conversation goes on (envs.actions).
"""

import sys

from megatron_rl_bi.envs import sandbox
from megatron_rl_bi.envs.actions import no_action_observation
from megatron_rl_bi.envs.verifiers import tagged_answer

OUTPUT_CHARACTERS = 8192  # what a program's output may bring back, before the token limit
UNISOLATED_FLAG = "--rl-code-without-isolation"


def run_python(program: str, config: sandbox.SandboxConfig) -> str:
    """The output (stdout, then stderr) of `program` run in the sandbox, at most
    OUTPUT_CHARACTERS; a program stopped at a limit says so."""
    result = sandbox.run(config, [config.python, "-I", "-B", "main.py"], {"main.py": program})
    output = (result.stdout + result.stderr)[:OUTPUT_CHARACTERS]
    if result.returncode is None:
        return output + f"\n(killed after {config.seconds:g} s)"
    return output + (f"\n(killed by signal {-result.returncode}: a limit)" if result.returncode < 0 else "")


ACTIONS = ("<code>program</code>", "<answer>answer</answer>")
# Running a program as a function schema, for --rl-tool-format chat (envs.tool_format).
CODE_TOOL = {"type": "function", "function": {
    "name": "code", "description": "Run a Python program; its output (stdout, then stderr) comes back.",
    "parameters": {"type": "object", "required": ["program"],
                   "properties": {"program": {"type": "string", "description": "the program's source"}}}}}


class CodeEnvironment:
    """One sample's conversation; the sandbox's settings come from `code_environment`."""

    sandbox_config = sandbox.SandboxConfig()
    stop_strings = ("</code>", "</answer>")
    tools = (CODE_TOOL,)

    def reset(self, example) -> str:
        self.example = example
        return example.prompt

    def step(self, text: str) -> tuple[str, float, bool]:
        if text.endswith("</code>"):
            program = text.rsplit("<code>", 1)[-1].removesuffix("</code>")
            return f"\n<output>{run_python(program, self.sandbox_config)}</output>\n", 0.0, False
        answer = tagged_answer(text)
        if answer is None:
            return no_action_observation(ACTIONS), 0.0, False
        return "", float(self.example.verify(answer)), True


def code_environment(config: sandbox.SandboxConfig) -> type:
    """The environment class whose programs run with `config`; refused (a ValueError naming the
    flags) when the sandbox cannot isolate programs here and the user did not opt out."""
    if config.isolated:
        try:
            sandbox.check(config.python)
        except sandbox.SandboxUnavailable as exc:
            raise ValueError(f"--rl-env code: the sandbox cannot isolate programs here: {exc}. Name another "
                             f"interpreter with --rl-code-python PATH, or run the programs without isolation "
                             f"(as this user, with its files and network) with {UNISOLATED_FLAG}") from None
    else:
        print(f"WARNING: {UNISOLATED_FLAG}: model-written programs run WITHOUT ISOLATION, as this user, "
              "with its files and its network; only their resource limits hold", file=sys.stderr, flush=True)
    return type("CodeEnvironment", (CodeEnvironment,), {"sandbox_config": config})
