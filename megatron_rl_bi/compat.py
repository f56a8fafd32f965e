"""Workarounds for upstream behaviour, each citing what it works around and when it can go.

Every patch of a library lives here and nowhere else.
"""

import contextlib
import importlib.util

from megatron.core.transformer.custom_layers import batch_invariant_kernels as _mcore_bik


def transformer_engine_installed() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None


@contextlib.contextmanager
def transformer_engine_optional():
    """Lets megatron-core's `enable_batch_invariant_mode()` run without TransformerEngine.

    megatron-core 0.19.2 `enable_batch_invariant_mode()` registers the aten overrides, sets its
    mode flag and only then calls `_te_patch_for_batch_invariant()`, which imports
    transformer_engine unconditionally: without TE it raises ModuleNotFoundError and leaves the
    mode half-enabled. Without TE there is nothing to patch, so the TE step is skipped for the
    duration of the call. Remove once upstream treats TE as optional there
    (tests/unit_tests/test_bi_switch.py::test_upstream_enable_without_te_half_enables pins it).
    """
    if transformer_engine_installed():
        yield
        return
    original = _mcore_bik._te_patch_for_batch_invariant
    _mcore_bik._te_patch_for_batch_invariant = lambda: None
    try:
        yield
    finally:
        _mcore_bik._te_patch_for_batch_invariant = original
