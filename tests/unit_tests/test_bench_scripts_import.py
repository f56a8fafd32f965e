"""Every bench script loads on a CPU: a name missing at import time (a decorator's module, say)
otherwise shows first on the H200, after its device time is spent."""

import glob
import importlib.util
import os

import pytest

from .. import REPO


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(REPO, "bench", "*.py"))), ids=os.path.basename)
def test_the_bench_script_loads(path):
    spec = importlib.util.spec_from_file_location(f"bench_script_{os.path.basename(path)[:-3]}", path)
    spec.loader.exec_module(importlib.util.module_from_spec(spec))
