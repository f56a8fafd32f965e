"""Provenance (CPU): the source hash follows the code and nothing else, a commit's hash can be
recomputed from git alone, a declared commit is recorded as declared, the checkout's commit is
read from git (or 'unknown' outside one), and result files stamped with a source hash match the
commit they name."""

import glob
import importlib.util
import json
import os
import subprocess

import pytest

from megatron_rl_bi.reporting import provenance
from megatron_rl_bi.reporting.provenance import read_stamps, source_hash, stamped_commit

from .. import REPO

_spec = importlib.util.spec_from_file_location("source_hash_tool", REPO / "tools" / "source_hash.py")
tool = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tool)


def _git(root, *command):
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *command], cwd=root,
                          check=True, capture_output=True, text=True).stdout.strip()


@pytest.fixture
def tree(tmp_path):
    """A small checkout: two package files, a tool, a recipe and a README, committed."""
    for name, text in {"megatron_rl_bi/a.py": "A = 1\n", "megatron_rl_bi/sub/b.py": "B = 2\n",
                       "tools/t.py": "print()\n", "examples/recipes/r.yaml": "lr: 1\n",
                       "README.md": "# readme\n"}.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "add", ".")
    _git(tmp_path, "commit", "-q", "-m", "tree")
    return tmp_path


def test_the_source_hash_follows_the_code_and_nothing_else(tree):
    before = source_hash(tree)
    (tree / "README.md").write_text("# other words\n")
    (tree / "megatron_rl_bi" / "__pycache__").mkdir()
    (tree / "megatron_rl_bi" / "__pycache__" / "a.cpython-312.pyc").write_bytes(b"\0")
    os.utime(tree / "megatron_rl_bi" / "a.py", (0, 0))
    assert source_hash(tree) == before
    changed = []
    for change in (lambda: (tree / "megatron_rl_bi" / "a.py").write_text("A = 2\n"),
                   lambda: (tree / "examples" / "recipes" / "r.yaml").write_text("lr: 2\n"),
                   lambda: (tree / "megatron_rl_bi" / "new.py").write_text(""),
                   lambda: (tree / "tools" / "t.py").rename(tree / "tools" / "u.py")):
        change()
        changed.append(source_hash(tree))
    assert len({before, *changed}) == 5


def test_a_commits_hash_is_recomputed_from_git(tree):
    commit = _git(tree, "rev-parse", "HEAD")
    assert tool.commit_source_hash(commit, tree) == source_hash(tree)
    (tree / "megatron_rl_bi" / "a.py").write_text("A = 3\n")
    assert tool.commit_source_hash(commit, tree) != source_hash(tree)


def test_stamps_are_checked_against_their_commit(tree, tmp_path_factory):
    commit = _git(tree, "rev-parse", "HEAD")
    files = tmp_path_factory.mktemp("results")
    stamps = {"good.json": {"git_commit": commit, "source_hash": source_hash(tree)},
              "declared.json": {"git_commit": "unknown", "declared_commit": commit, "source_hash": source_hash(tree)},
              "stale_git.json": {"git_commit": "0" * 40 + "-dirty", "declared_commit": commit,
                                 "source_hash": source_hash(tree)},
              "declared_wrongly.json": {"git_commit": "unknown", "declared_commit": commit,
                                        "source_hash": "1" * 64},
              "bad.json": {"git_commit": commit, "source_hash": "0" * 64},
              "dirty.json": {"git_commit": commit + "-dirty", "source_hash": source_hash(tree)},
              "nested.json": {"git_commit": "0" * 40, "declared_commit": commit, "source_hash": source_hash(tree)},
              "declared_short.json": {"git_commit": commit, "declared_commit": commit[:7],
                                      "source_hash": source_hash(tree)},
              "old.json": {"git_commit": commit}}
    for name, stamp in stamps.items():
        (files / name).write_text(json.dumps({**stamp, "result": 1}))
    (files / "two.jsonl").write_text("\n".join(json.dumps(r) for r in (
        {"run": stamps["good.json"]}, {"step": 1}, {"run": stamps["bad.json"]}, {"step": 2})))
    problems = {name: tool.stamp_problems(str(files / name), tree) for name in [*stamps, "two.jsonl"]}
    assert problems["good.json"] == problems["declared.json"] == problems["stale_git.json"] == []
    assert problems["nested.json"] == []  # a clean checkout's HEAD that named other code
    assert problems["declared_short.json"] == []
    assert stamped_commit(stamps["declared_short.json"]) == commit  # named in full
    # a dirty checkout names no commit: the declared one is the stamp's, even where it is the checkout's prefix
    assert stamped_commit({"git_commit": commit + "-dirty", "declared_commit": commit[:7]}) == commit[:7]
    assert problems["declared_wrongly.json"][0].endswith(f"is not {commit[:12]}'s ({source_hash(tree)[:12]})")
    assert problems["bad.json"] == [f"{files}/bad.json: source_hash 000000000000 is not "
                                    f"{commit[:12]}'s ({source_hash(tree)[:12]})"]
    assert problems["dirty.json"] == [f"{files}/dirty.json: written from {commit}-dirty, not a clean commit"]
    assert problems["old.json"] == [f"{files}/old.json: stamp of {commit} has no source_hash"]
    assert len(problems["two.jsonl"]) == 1  # its second process's stamp


def test_a_file_without_a_stamp_is_an_error(tmp_path):
    (tmp_path / "r.json").write_text('{"result": 1}')
    with pytest.raises(ValueError, match="r.json: no provenance stamp"):
        read_stamps(str(tmp_path / "r.json"))


def test_a_declared_commit_is_recorded_as_declared(monkeypatch, tree):
    monkeypatch.setattr(provenance, "REPO", tree)
    monkeypatch.setenv("GIT_COMMIT", "f00d")
    stamp = provenance.provenance()
    assert stamp["declared_commit"] == "f00d"
    assert stamp["git_commit"] == _git(tree, "rev-parse", "HEAD")
    assert stamp["source_hash"] == source_hash(tree)
    (tree / "megatron_rl_bi" / "a.py").write_text("A = 4\n")
    assert provenance.git_commit() == _git(tree, "rev-parse", "HEAD") + "-dirty"


def test_an_untracked_file_leaves_the_checkout_clean(monkeypatch, tree):
    monkeypatch.setattr(provenance, "REPO", tree)
    (tree / "result.json").write_text("{}")  # a run's output, not added
    assert provenance.git_commit() == _git(tree, "rev-parse", "HEAD")


def test_without_git_the_commit_is_unknown(monkeypatch, tree, tmp_path_factory):
    monkeypatch.setattr(provenance, "REPO", tree)
    monkeypatch.setenv("PATH", str(tmp_path_factory.mktemp("no_git")))  # no git to run
    assert provenance.git_commit() == "unknown"


def test_a_copy_inside_another_checkout_has_no_commit_of_its_own(monkeypatch, tree):
    copy = tree / "ignored" / "older"
    (copy / "megatron_rl_bi").mkdir(parents=True)
    (copy / "megatron_rl_bi" / "a.py").write_text("A = 0\n")
    (tree / ".gitignore").write_text("ignored/\n")
    _git(tree, "add", ".gitignore")
    _git(tree, "commit", "-q", "-m", "ignore")
    monkeypatch.setattr(provenance, "REPO", copy)
    monkeypatch.setenv("GIT_COMMIT", "f00d")
    stamp = provenance.provenance()
    assert stamp["git_commit"] == "unknown" and stamped_commit(stamp) == "f00d"
    assert stamp["source_hash"] == source_hash(copy) != source_hash(tree)


def test_outside_a_checkout_the_commit_is_unknown_and_the_hash_still_names_the_code(monkeypatch, tree):
    (tree / ".git").rename(tree / "not-git")
    monkeypatch.setattr(provenance, "REPO", tree)
    monkeypatch.delenv("GIT_COMMIT", raising=False)
    stamp = provenance.provenance()
    assert stamp["git_commit"] == "unknown" and "declared_commit" not in stamp
    assert stamp["source_hash"] == source_hash(tree)


def _has_source_hash(path: str) -> bool:
    try:
        return any("source_hash" in stamp for stamp in read_stamps(path))
    except ValueError:  # no stamp at all: older files, results/README.md says which commit made them
        return False


def _stamped_files() -> list[str]:
    names = glob.glob(str(REPO / "results" / "*.json*")) + glob.glob(
        str(REPO / "tests" / "functional_tests" / "test_cases" / "*" / "*" / "golden_values_*.json"))
    return sorted(p for p in names if _has_source_hash(p))


@pytest.mark.parametrize("path", _stamped_files(), ids=lambda p: os.path.relpath(p, REPO))
def test_result_files_match_the_code_of_their_commit(path):
    for stamp in read_stamps(path):
        commit = stamped_commit(stamp).removesuffix("-dirty")
        if subprocess.run(["git", "cat-file", "-e", f"{commit}^{{commit}}"], cwd=REPO).returncode:
            pytest.skip(f"commit {commit} is not in this clone's history (a shallow clone)")
    assert tool.stamp_problems(path) == []


SOURCE_HASH_SINCE = "cc633b9"  # the commit whose stamps first carried a source hash (results/README.md)


@pytest.mark.parametrize("path", sorted(set(glob.glob(str(REPO / "results" / "*.json*"))) - set(_stamped_files())),
                         ids=lambda p: os.path.relpath(p, REPO))
def test_a_result_file_without_a_source_hash_predates_it(path):
    for stamp in read_stamps(path):
        commit = stamp["git_commit"].removesuffix("-dirty")
        if subprocess.run(["git", "cat-file", "-e", f"{commit}^{{commit}}"], cwd=REPO).returncode:
            pytest.skip(f"commit {commit} is not in this clone's history (a shallow clone)")
        later = subprocess.run(["git", "merge-base", "--is-ancestor", SOURCE_HASH_SINCE, commit], cwd=REPO)
        assert later.returncode == 1, f"{commit} is {SOURCE_HASH_SINCE} or after it, and its stamp has no source hash"
