"""The built-in code environment (`--rl-env code`): the model may run Python before it answers.
`<code>...</code>` runs in a sandbox and its output comes back as `<output>...</output>`;
`<answer>...</answer>` ends the conversation, scored by the task's own verifier (countdown's, the
math verifier of a JSONL task, ...); a turn with neither is told so and the conversation goes on
(envs.actions).

The sandbox is a fresh Python process (`-I`: no user site, no environment variables) in a fresh
temporary directory, with CPU time, memory, file size and open-file limits, killed at its wall
clock limit. Before the program runs, an audit hook refuses what the program must not do: any
socket connection, bind or name lookup, starting processes (subprocess, os.system, exec, fork),
ctypes, and opening, listing or changing files outside its directory (the Python installation
stays readable, for imports). Audit hooks cover what Python itself does, C extensions included
(the socket module raises its events in C); they are not a container: run untrusted models'
code in a container or VM as well.
"""

import os
import subprocess
import sys
import tempfile

from megatron_rl_bi.envs.actions import no_action_observation
from megatron_rl_bi.envs.verifiers import tagged_answer

OUTPUT_CHARACTERS = 8192  # what a program's output may bring back, before the token limit

# Runs in the sandbox (argv: CPU seconds, memory bytes): sets its own limits (not in a
# preexec_fn, which is unsafe in a threaded parent), reads the program, then installs the hook
# that guards everything after.
_BOOTSTRAP = r"""
import os, resource, sys
for limit, value in ((resource.RLIMIT_CPU, int(sys.argv[1])), (resource.RLIMIT_AS, int(sys.argv[2])),
                     (resource.RLIMIT_FSIZE, 2**24), (resource.RLIMIT_NOFILE, 64), (resource.RLIMIT_CORE, 0)):
    resource.setrlimit(limit, (value, value))
root = os.getcwd()
source = open("main.py").read()
readable = tuple(os.path.realpath(p) + os.sep for p in {sys.prefix, sys.base_prefix, sys.exec_prefix})
refused = {"socket.connect", "socket.bind", "socket.getaddrinfo", "socket.gethostbyname",
           "socket.gethostbyaddr", "socket.sendto", "socket.sendmsg", "subprocess.Popen", "os.system",
           "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty", "os.kill", "os.killpg",
           "ctypes.dlopen", "ctypes.dlsym", "ctypes.cdata", "sys.addaudithook"}
listings = {"os.listdir", "os.scandir"}
changes = {"os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.chdir", "os.chmod", "os.link", "os.symlink",
           "os.truncate", "shutil.rmtree"}

def inside(path):
    full = os.path.realpath(os.path.join(root, os.fsdecode(path)))
    return full == root or full.startswith(root + os.sep), full

def hook(event, args):
    if event in refused:
        raise PermissionError(f"sandbox: {event} is not allowed")
    if event == "open" and not isinstance(args[0], int):
        ok, full = inside(args[0])
        mode, flags = args[1], args[2]
        writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
            mode is None and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT))
        if not ok and (writing or not (full + os.sep).startswith(readable)):
            raise PermissionError(f"sandbox: {os.fsdecode(args[0])} is outside its directory")
    elif (event in listings or event in changes) and args and isinstance(args[0], (str, bytes, os.PathLike)):
        ok, full = inside(args[0])
        if not ok and (event in changes or not (full + os.sep).startswith(readable)):
            raise PermissionError(f"sandbox: {os.fsdecode(args[0])} is outside its directory")

sys.addaudithook(hook)
del hook
exec(compile(source, "main.py", "exec"), {"__name__": "__main__"})
"""


def run_python(program: str, seconds: float, memory_mb: int) -> str:
    """The output (stdout, then stderr) of `program` run in the sandbox, at most
    OUTPUT_CHARACTERS; a program killed at its time limit says so."""
    with tempfile.TemporaryDirectory(prefix="rl_code_") as directory:
        with open(os.path.join(directory, "main.py"), "w") as f:
            f.write(program)
        try:
            done = subprocess.run([sys.executable, "-I", "-B", "-c", _BOOTSTRAP, str(max(1, int(seconds))),
                                   str(memory_mb * 2**20)], cwd=directory, env={}, stdin=subprocess.DEVNULL,
                                  capture_output=True, timeout=seconds)
        except subprocess.TimeoutExpired as expired:
            output = (expired.stdout or b"") + (expired.stderr or b"")
            return output.decode(errors="replace")[:OUTPUT_CHARACTERS] + f"\n(killed after {seconds:g} s)"
    output = (done.stdout + done.stderr).decode(errors="replace")[:OUTPUT_CHARACTERS]
    return output + (f"\n(killed by signal {-done.returncode}: a limit)" if done.returncode < 0 else "")


ACTIONS = ("<code>program</code>", "<answer>answer</answer>")
# Running a program as a function schema, for --rl-tool-format chat (envs.tool_format).
CODE_TOOL = {"type": "function", "function": {
    "name": "code", "description": "Run a Python program; its output (stdout, then stderr) comes back.",
    "parameters": {"type": "object", "required": ["program"],
                   "properties": {"program": {"type": "string", "description": "the program's source"}}}}}


class CodeEnvironment:
    """One sample's conversation; the limits come from `code_environment`."""

    seconds = 5.0
    memory_mb = 1024
    stop_strings = ("</code>", "</answer>")
    tools = (CODE_TOOL,)

    def reset(self, example) -> str:
        self.example = example
        return example.prompt

    def step(self, text: str) -> tuple[str, float, bool]:
        if text.endswith("</code>"):
            program = text.rsplit("<code>", 1)[-1].removesuffix("</code>")
            return f"\n<output>{run_python(program, self.seconds, self.memory_mb)}</output>\n", 0.0, False
        answer = tagged_answer(text)
        if answer is None:
            return no_action_observation(ACTIONS), 0.0, False
        return "", float(self.example.verify(answer)), True


def code_environment(seconds: float, memory_mb: int) -> type:
    """The environment class whose programs run with these limits."""
    return type("CodeEnvironment", (CodeEnvironment,), {"seconds": seconds, "memory_mb": memory_mb})
