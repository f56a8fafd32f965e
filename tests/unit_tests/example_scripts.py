"""Runs an examples/ script in a copy with `python` and `torchrun` stubbed: each call it would make
is logged instead of run, so a test sees the exact commands (and pretrain_rl.py's flags) it makes."""

import os
import shutil
import subprocess

from .. import REPO

STUB = """#!/usr/bin/env bash
echo "$(basename "$0") $*" >> "$STUB_LOG"
if [ "$1" = tools/random_hf_checkpoint.py ]; then mkdir -p "$3"; fi
"""


def run_stubbed(tmp_path, script: str, *args, env: dict | None = None) -> tuple[subprocess.CompletedProcess, list[str]]:
    """examples/`script` with `args` (and `env` added to the environment): (its completed process,
    the commands it called, in order)."""
    shutil.copytree(os.path.join(REPO, "examples"), tmp_path / "examples")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("python", "torchrun"):
        (bin_dir / name).write_text(STUB)
        (bin_dir / name).chmod(0o755)
    env = {**os.environ, **(env or {}), "PATH": f"{bin_dir}:{os.environ['PATH']}", "STUB_LOG": str(tmp_path / "calls")}
    done = subprocess.run(["bash", str(tmp_path / "examples" / script), *args], env=env,
                          capture_output=True, text=True)
    calls = (tmp_path / "calls").read_text().splitlines() if (tmp_path / "calls").exists() else []
    return done, calls


def pretrain_rl_flags(tmp_path, script: str, *args) -> list[str]:
    """The flags examples/`script` passes to pretrain_rl.py (through torchrun)."""
    done, calls = run_stubbed(tmp_path, script, *args)
    assert done.returncode == 0, done.stderr
    (run,) = [call.split() for call in calls if call.startswith("torchrun ")]
    return run[run.index("pretrain_rl.py") + 1:]
