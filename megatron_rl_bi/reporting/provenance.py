"""Provenance stamped into every result file: which device, code and library versions made it.

The code is named twice: by git (`git_commit`, HEAD of the checkout, `-dirty` with local
changes) and by content (`source_hash`, a hash of the package's source files as they are on
disk). The hash ties a result to code with or without `.git` (a copy of the tree on another
machine may carry a stale one, or none: the H200's copies carry the session's first commit): `python tools/source_hash.py --commit C` computes it
for a commit, to check a result's stamp. A commit given in $GIT_COMMIT is recorded as declared,
beside what the checkout says; a check reads the declared one where there is one.
"""

import datetime
import hashlib
import os
import pathlib
import subprocess
from importlib.metadata import PackageNotFoundError, version

import torch

from megatron_rl_bi.jsonfile import read_jsonl, read_object

_PACKAGES = ("torch", "triton", "megatron-core", "fla-core", "flash-attn-4", "flash-attn-3",
             "transformer-engine")
REPO = pathlib.Path(__file__).resolve().parents[2]
# What runs: the package, the entry point, the tools, the benches, the recipes and launchers.
SOURCE_PATTERNS = ("megatron_rl_bi/**/*.py", "pretrain_rl.py", "setup.py", "tools/*.py", "bench/*.py",
                   "examples/**/*.yaml", "examples/**/*.sh", "examples/**/*.sbatch")


def source_files(root: pathlib.Path) -> list[pathlib.Path]:
    """The source files under `root` that SOURCE_PATTERNS select, sorted."""
    found = {path for pattern in SOURCE_PATTERNS for path in root.glob(pattern) if path.is_file()}
    return sorted(found, key=lambda path: path.relative_to(root).as_posix())


def source_hash(root: pathlib.Path) -> str:
    """sha256 over every source file's relative path and bytes: equal trees, equal hashes."""
    digest = hashlib.sha256()
    for path in source_files(root):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0")
        digest.update(hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()


def _git(*command: str) -> str:
    return subprocess.run(["git", *command], cwd=REPO, capture_output=True, text=True,
                          check=True).stdout.strip()


def git_commit() -> str:
    """HEAD of the checkout, with '-dirty' if tracked files have local changes; 'unknown'
    without git or a checkout, or where the tree is a copy inside another checkout (an older
    commit's tree under an ignored folder: that checkout's HEAD names other code)."""
    try:
        if pathlib.Path(_git("rev-parse", "--show-toplevel")).resolve() != REPO.resolve():
            return "unknown"
        dirty = _git("status", "--porcelain", "--untracked-files=no")
        return _git("rev-parse", "HEAD") + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _package_version(name: str) -> str | None:
    try:
        return version(name)
    except PackageNotFoundError:
        return None


def provenance() -> dict:
    stamp = {
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "git_commit": git_commit(),
        "source_hash": source_hash(REPO),
        "versions": {name: _package_version(name) for name in _PACKAGES},
        "utc_time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    if os.environ.get("GIT_COMMIT"):
        stamp["declared_commit"] = os.environ["GIT_COMMIT"]
    return stamp


def stamped_commit(stamp: dict) -> str:
    """The commit a stamp names: the checkout's where it is clean and the declared one (from
    $GIT_COMMIT) is none or its prefix, else the declared one. The stamp's source hash has to
    match it (tools/source_hash.py), so a declaration is checked, not trusted; it wins over a
    clean checkout's other commit because git can name other code than what ran (a copy inside
    another checkout, stamped before git_commit saw that)."""
    commit, declared = stamp.get("git_commit", "unknown"), stamp.get("declared_commit")
    if declared is None or (commit.startswith(declared) and not commit.endswith("-dirty")):
        return commit
    return declared


def read_stamps(path: str) -> list[dict]:
    """The provenance stamps of a result file: a JSON report's top level (or its `provenance`,
    for golden values), or each `{"run": ...}` header of a JSONL (one per process that wrote
    to it). A file without any is an error."""
    if path.endswith(".jsonl"):
        stamps = [r["run"] for r in read_jsonl(path) if "run" in r]
    else:
        report = read_object(path)
        stamps = [report.get("provenance", report)]
    stamps = [s for s in stamps if "git_commit" in s]
    if not stamps:
        raise ValueError(f"{path}: no provenance stamp (git_commit)")
    return stamps
