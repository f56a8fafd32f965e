"""The package's shape, checked on its source: imports point down the data flow, and every
function fits on a screen."""

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "megatron_rl_bi"
MAX_FUNCTION_LINES = 60

# What each layer may import from this package (besides itself), bottom to top; a module whose
# layer is missing here fails the test (a new layer needs its place). config, which turns flags
# into every component's config, is the top and may import any layer.
ALLOWED = {
    "__init__": set(),
    "compat": set(),
    "jsonfile": set(),
    "packing": set(),
    "numerics": set(),
    "distributed": set(),
    "compiling": set(),
    "bi": {"compat"},
    "attention": {"bi", "packing"},
    "models": {"bi", "compat", "attention", "packing", "memory", "numerics"},
    "inference": {"bi", "compat"},
    "parity": {"distributed", "packing", "models", "inference"},
    "envs": {"jsonfile", "compat"},
    "reporting": {"jsonfile"},
    "optimizer": set(),
    "memory": set(),
    "checkpoints": {"jsonfile", "packing", "numerics"},
    "launch": {"bridge", "checkpoints", "distributed"},
    "bridge": set(),
    "rl": {"bridge", "checkpoints", "distributed", "envs", "inference", "models", "packing", "parity", "reporting",
           "bi", "compat", "jsonfile", "optimizer", "attention"},
}
TOP = "config"


def _modules():
    return sorted(p for p in PACKAGE.rglob("*.py"))


def _layer(path: pathlib.Path) -> str:
    return path.relative_to(PACKAGE).parts[0].removesuffix(".py")


def _package_imports(tree: ast.AST) -> set[str]:
    layers = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module + "." + alias.name for alias in node.names]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            continue
        for name in names:
            parts = name.split(".")
            if parts[0] == "megatron_rl_bi" and len(parts) > 1:
                layers.add(parts[1])
    return layers


@pytest.mark.parametrize("path", [p for p in _modules() if _layer(p) != TOP],
                         ids=lambda p: str(p.relative_to(PACKAGE)))
def test_imports_point_down(path):
    """Every module below config imports only the layers below its own (config, the top, is
    checked by never being imported: ALLOWED names it nowhere)."""
    layer = _layer(path)
    assert TOP not in set().union(*ALLOWED.values())
    assert layer in ALLOWED, f"{layer} has no place in the layering: add it to ALLOWED"
    imported = _package_imports(ast.parse(path.read_text())) - {layer}
    assert imported <= ALLOWED[layer], f"{layer} imports {sorted(imported - ALLOWED[layer])}"


def test_functions_fit_on_a_screen():
    too_long = []
    for path in _modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    too_long.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {node.name} ({lines})")
    assert not too_long, too_long


def test_the_checks_see_a_violation(tmp_path):
    """The import walk finds a `from megatron_rl_bi.rl...` import nested in a function."""
    tree = ast.parse("def f():\n    from megatron_rl_bi.rl.step import StepConfig\n")
    assert _package_imports(tree) == {"rl"}
