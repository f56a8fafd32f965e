"""tools/source_hash.py --check on stamps it cannot tie to code."""

import json

from tests import REPO


def _stamp_problems():
    import importlib.util

    spec = importlib.util.spec_from_file_location("source_hash", REPO / "tools" / "source_hash.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.stamp_problems


def test_a_commit_missing_from_the_repository_is_named_not_a_crash(tmp_path):
    """A branch's commit that did not land (each session's checkout holds main only): git archive
    failed on it and the whole check stopped."""
    path = tmp_path / "result.json"
    path.write_text(json.dumps({"git_commit": "unknown", "declared_commit": "0123456789ab" * 3 + "0123",
                                "source_hash": "f00d"}))
    assert _stamp_problems()(str(path)) == [
        f"{path}: its commit 0123456789ab is not in this repository (a branch that did not land): its stamp "
        "cannot be checked"]
