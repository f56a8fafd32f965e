r"""The source hash of this checkout or of a commit, and whether result files match the code
they name (see megatron_rl_bi/reporting/provenance.py).

  python tools/source_hash.py                       # this checkout, as it is on disk
  python tools/source_hash.py --commit 52910d4      # that commit (git archive, no checkout)
  python tools/source_hash.py --check results/rl_qwen3_4b_8k_h200.jsonl ...
      # each file's stamped source_hash equals the hash of its stamped commit (exit 1 if not)
"""

import argparse
import os
import pathlib
import subprocess
import sys
import tarfile
import tempfile

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from megatron_rl_bi.reporting.provenance import read_stamps, source_hash, stamped_commit  # noqa: E402


def commit_source_hash(commit: str, repo: pathlib.Path = REPO) -> str:
    """The source hash of `commit`'s tree, read with git archive."""
    with tempfile.TemporaryDirectory() as tmp:
        archive = os.path.join(tmp, "tree.tar")
        subprocess.run(["git", "archive", "--format=tar", "-o", archive, commit], cwd=repo,
                       check=True, capture_output=True)
        with tarfile.open(archive) as tar:
            tar.extractall(os.path.join(tmp, "tree"), filter="data")
        return source_hash(pathlib.Path(tmp, "tree"))


def in_repository(commit: str, repo: pathlib.Path = REPO) -> bool:
    return subprocess.run(["git", "cat-file", "-e", f"{commit}^{{commit}}"], cwd=repo, capture_output=True).returncode == 0


def stamp_problems(path: str, repo: pathlib.Path = REPO) -> list[str]:
    """Why each stamp of result file `path` does not tie it to a clean commit's code (the
    declared commit where one was, else the checkout's)."""
    problems = []
    for stamp in read_stamps(path):
        commit, stamped = stamped_commit(stamp), stamp.get("source_hash")
        if stamped is None:
            problems.append(f"{path}: stamp of {commit} has no source_hash")
        elif commit == "unknown" or commit.endswith("-dirty"):
            problems.append(f"{path}: written from {commit}, not a clean commit")
        elif not in_repository(commit, repo):
            problems.append(f"{path}: its commit {commit[:12]} is not in this repository (a branch that did not "
                            "land): its stamp cannot be checked")
        elif stamped != (actual := commit_source_hash(commit, repo)):
            problems.append(f"{path}: source_hash {stamped[:12]} is not {commit[:12]}'s ({actual[:12]})")
    return problems


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--commit", help="hash this commit's tree instead of the checkout")
    parser.add_argument("--check", nargs="+", metavar="FILE", help="result files to check")
    return parser


def main() -> None:
    parser = build_parser()
    args = parser.parse_args()
    try:
        if args.check:
            problems = [p for path in args.check for p in stamp_problems(path)]
            print("\n".join(problems) if problems else f"every stamp matches its commit ({len(args.check)} files)")
            sys.exit(1 if problems else 0)
        print(commit_source_hash(args.commit) if args.commit else source_hash(REPO))
    except (OSError, ValueError, subprocess.CalledProcessError) as exc:
        parser.error(str(getattr(exc, "stderr", "") or exc).strip())


if __name__ == "__main__":
    main()
