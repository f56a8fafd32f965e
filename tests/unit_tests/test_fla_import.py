"""A run imports fla's kernels (fla-core) and not fla's layers and models (flash-linear-attention,
not a dependency): with that package installed, the first import of anything in fla imports all
its models, 13 s of a process's start on an H100 (cProfile at 279dfc6)."""

import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_a_runs_imports_leave_fla_s_models_out():
    program = ("import importlib.util, json, sys; spec = importlib.util.spec_from_file_location('pretrain_rl', sys.argv[1]); "
               "spec.loader.exec_module(importlib.util.module_from_spec(spec)); "
               "import megatron.core.models.hybrid.hybrid_layer_specs; "
               "print(json.dumps([sorted(m for m in sys.modules if m.startswith('fla.ops')),"
               " [m for m in ('fla.layers', 'fla.models') if m in sys.modules]]))")
    done = subprocess.run([sys.executable, "-c", program, os.path.join(REPO, "pretrain_rl.py")],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    loaded, models = json.loads(done.stdout.strip().splitlines()[-1])
    assert loaded and models == []  # fla's kernels imported, its models not
