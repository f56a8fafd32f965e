"""The sandbox's test fixtures: bubblewrap installed where the machine lacks it (as CI's clean
machines do: the project installs it, never a person by hand), a Python the sandbox can run,
and the same program run outside the sandbox, for the escape tests' controls."""

import os
import shutil
import signal
import subprocess
import tempfile

import pytest

from megatron_rl_bi.envs import sandbox


def install_bubblewrap() -> None:
    """bwrap from the distribution's package (root and apt-get: Debian, Ubuntu), or a failure
    saying how to get it; never a skip: the escape suite must run with real isolation."""
    if shutil.which(sandbox.BUBBLEWRAP):
        return
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        pytest.fail(f"the sandbox tests need bubblewrap and cannot install it here: {sandbox.INSTALL_HINT}")
    for command in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", "bubblewrap"]):
        done = subprocess.run(command, capture_output=True, text=True,
                              env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})
        if done.returncode != 0:
            pytest.fail(f"{' '.join(command)} failed: {done.stderr[-500:]}")


def sandbox_python() -> str:
    """This process's base interpreter if the sandbox can run it; as root, its uid 65534 may not
    reach it (a pyenv under /root), and the system's python3 serves."""
    install_bubblewrap()
    problems = []
    for candidate in (sandbox.base_interpreter(), "/usr/bin/python3", "/usr/local/bin/python3"):
        if not os.path.exists(candidate):
            continue
        try:
            sandbox.check(candidate)
            return os.path.realpath(candidate)
        except sandbox.SandboxUnavailable as exc:
            problems.append(f"{candidate}: {exc}")
    pytest.fail("no Python the sandbox can isolate: " + "; ".join(problems))


def run_outside(program: str, python: str, seconds: float = 10.0) -> str:
    """The same program run as a plain child of this process (this user, its files, network and
    environment): what each escape does where nothing stops it. Its process group is killed
    after `seconds`; stdout then stderr, at most 1 MiB each."""
    with tempfile.TemporaryDirectory(prefix="rl_outside_") as directory:
        with open(os.path.join(directory, "main.py"), "w") as f:
            f.write(program)
        with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
            process = subprocess.Popen([python, "-I", "-B", "main.py"], cwd=directory, stdout=out, stderr=err,
                                       stdin=subprocess.DEVNULL, start_new_session=True)
            try:
                process.wait(timeout=seconds)
            except subprocess.TimeoutExpired:
                pass
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            process.wait()
            out.seek(0)
            err.seek(0)
            return (out.read(1 << 20) + err.read(1 << 20)).decode(errors="replace")

