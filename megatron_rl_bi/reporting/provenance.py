"""Provenance stamped into every result file: which device, code and library versions made it."""

import datetime
import os
import subprocess
from importlib.metadata import PackageNotFoundError, version

import torch

_PACKAGES = ("torch", "triton", "megatron-core", "fla-core", "flash-attn-4", "flash-attn-3",
             "transformer-engine")


def git_commit() -> str:
    """$GIT_COMMIT when set (a copy of the tree on a remote machine may carry a stale .git),
    else HEAD of the checkout (with '-dirty' if it has local changes), else 'unknown'."""
    if os.environ.get("GIT_COMMIT"):
        return os.environ["GIT_COMMIT"]
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=root, capture_output=True, text=True, check=True,
        ).stdout.strip()
        return head + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _package_version(name: str) -> str | None:
    try:
        return version(name)
    except PackageNotFoundError:
        return None


def provenance() -> dict:
    return {
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "git_commit": git_commit(),
        "versions": {name: _package_version(name) for name in _PACKAGES},
        "utc_time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
