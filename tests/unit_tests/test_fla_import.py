"""A run imports fla's kernels (fla-core) and not fla's layers and models (flash-linear-attention,
not a dependency): with that package installed, the first import of anything in fla imports all
its models, 13 s of a process's start on an H100 (cProfile at 279dfc6)."""

import json

from .conftest import run_after_loading_pretrain_rl


def test_a_runs_imports_leave_fla_s_models_out():
    shown = run_after_loading_pretrain_rl(
        "import json, sys\nimport megatron.core.models.hybrid.hybrid_layer_specs\n"
        "print(json.dumps([sorted(m for m in sys.modules if m.startswith('fla.ops')),"
        " [m for m in ('fla.layers', 'fla.models') if m in sys.modules]]))")
    loaded, models = json.loads(shown)
    assert loaded and models == []  # fla's kernels imported, its models not
