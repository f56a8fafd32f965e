"""The one batch-invariance switch.

Turning it on routes aten mm/addmm/_log_softmax/mean.dim to megatron-core's batch-invariant Triton
kernels (and, when TransformerEngine is installed, patches TE's GEMM and RMSNorm entry points the
way megatron-core does), with six of megatron-core's pieces replaced where its overrides and TE
patches look them up:
- its GEMM (`matmul_persistent`) by `bi.gemm.matmul` (same bits, near cuBLAS speed);
- its log-softmax (`log_softmax`) by `bi.log_softmax.log_softmax` (same bits, few rows split);
- its mean (`mean_batch_invariant`, which returns the sum for a full mean) by `bi.mean.mean`;
- its RMSNorm (`BatchInvariantRMSNormFn`, whose forward also drops zero-centred gamma) by
  `bi.rmsnorm.BatchInvariantRMSNorm`;
- its TE GEMM patch (`_te_general_gemm_patched`, which copies operands and ignores `accumulate`)
  by `bi.te_gemm.general_gemm`;
- its TE fused-norm patch (`_te_apply_normalization_patched`, ~8 fp32 passes) by
  `bi.rmsnorm.te_apply_normalization`.
It also makes torch's embedding backward repeat its bits (`bi.embedding`: one op run with torch's
deterministic-algorithms flag), which megatron-core leaves to chance, and Triton's autotuned
kernels (fla's chunked GDN kernels) choose their configuration without timing (`bi.autotune`).

Modules of this package ask `enabled()` at forward time; nobody threads a flag through call chains.

Departure from upstream: enabling is atomic. megatron-core's own `enable_batch_invariant_mode()`
can fail half way (see compat.transformer_engine_optional); here a failure rolls everything back
and raises one `BatchInvariantModeError`.
"""

import contextlib
from collections.abc import Iterator

from megatron.core.transformer.custom_layers import batch_invariant_kernels as _mcore_bik

from megatron_rl_bi import compat
from megatron_rl_bi.bi import autotune, embedding, gemm, log_softmax, mean, rmsnorm, te_gemm

# megatron-core's BI pieces that its overrides look up at call time, or its enabling installs into
# TE (so ours go in first), and ours.
_OURS = {"matmul_persistent": gemm.matmul,
         "log_softmax": log_softmax.log_softmax,
         "mean_batch_invariant": mean.mean,
         "BatchInvariantRMSNormFn": rmsnorm.BatchInvariantRMSNorm,
         "_te_general_gemm_patched": te_gemm.general_gemm,
         "_te_apply_normalization_patched": rmsnorm.te_apply_normalization}
_UPSTREAM = {name: getattr(_mcore_bik, name) for name in _OURS}


class BatchInvariantModeError(RuntimeError):
    """Batch-invariant mode could not be entered; nothing was left enabled."""


def enabled() -> bool:
    return _mcore_bik.is_batch_invariant_mode_enabled()


def enable() -> None:
    if enabled():
        return
    try:
        for name, kernel in _OURS.items():
            setattr(_mcore_bik, name, kernel)
        with compat.transformer_engine_optional():
            _mcore_bik.enable_batch_invariant_mode()
        embedding.install()
        autotune.install()
    except Exception as exc:
        disable()
        raise BatchInvariantModeError(
            f"could not enable batch-invariant mode ({type(exc).__name__}: {exc}); "
            "every override was rolled back"
        ) from exc


def disable() -> None:
    autotune.uninstall()
    embedding.uninstall()
    _mcore_bik.disable_batch_invariant_mode()
    for name, kernel in _UPSTREAM.items():
        setattr(_mcore_bik, name, kernel)


@contextlib.contextmanager
def batch_invariant(on: bool = True) -> Iterator[None]:
    """Runs the block with the switch set to `on`, then restores the previous state."""
    was_on = enabled()
    enable() if on else disable()
    try:
        yield
    finally:
        enable() if was_on else disable()
