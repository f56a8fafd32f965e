"""A user's object named on the command line: `MODULE:NAME` (an importable module) or
`path/to/file.py:NAME` (--rl-reward-fn, --rl-env)."""

import importlib
import importlib.util
import os


def load_plugin(spec: str, flag: str) -> object:
    """The object `spec` names; one ValueError naming `flag` when it cannot be had."""
    where = f"{flag} {spec}"
    module_name, _, name = spec.rpartition(":")
    if not module_name or not name:
        raise ValueError(f"{where}: expected MODULE:NAME or FILE.py:NAME")
    try:
        if module_name.endswith(".py"):
            if not os.path.isfile(module_name):
                raise FileNotFoundError(f"no file {module_name}")
            module_spec = importlib.util.spec_from_file_location(f"_plugin_{flag.strip('-').replace('-', '_')}",
                                                                 module_name)
            module = importlib.util.module_from_spec(module_spec)
            module_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(module_name)
    except Exception as exc:  # noqa: BLE001 - whatever the user's module raised, name the flag
        raise ValueError(f"{where}: cannot load {module_name} ({type(exc).__name__}: {exc})") from exc
    if not hasattr(module, name):
        raise ValueError(f"{where}: {module_name} has no {name!r}")
    return getattr(module, name)
