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

For the parity doctor's ablation (tools/parity_doctor.py --ablate) the switch can be entered with
pieces left off (`enable(without=...)`, names in PIECES); a module that owns a piece asks
`enabled(piece)`. A run's switch has every piece on.

Departure from upstream: enabling is atomic. megatron-core's own `enable_batch_invariant_mode()`
can fail half way (see compat.transformer_engine_optional); here a failure rolls everything back
and raises one `BatchInvariantModeError`.
"""

import contextlib
import sys
from collections.abc import Iterable, Iterator

import torch
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

# What each piece makes batch-invariant; with one left off, its stock counterpart runs.
PIECES = {
    "gemm": "aten mm/addmm, and TE's general_gemm where TE is installed, on the BI GEMM (stock: cuBLAS)",
    "log_softmax": "aten _log_softmax on the BI log-softmax (stock: torch's kernel)",
    "mean": "aten mean.dim on the BI mean (stock: torch's kernel)",
    "rmsnorm": "the local spec's RMSNorm on bi.rmsnorm (stock: torch's rms_norm)",
    "te_norm": "TE's RMSNorm and fused norm+linear normalization on bi.rmsnorm (stock: TE's kernels)",
    "attention_split": "FlashAttention with one KV split in engine and trainer (stock: its heuristic)",
    "gdn_recurrent": "GDN's recurrent forward at every call shape (stock: fla's chunked kernel for prefill)",
    "flash_version": "the trainer's FlashAttention generation pinned to the engine's (off: the other one)",
    "fp32_logits": "the trainer's log-softmax of fp32 logits, as the engine's (off: of the params dtype's)",
}
# megatron-core registers its four aten overrides in one library; a piece's ops leave it when off
_ATEN_OPS = {"gemm": ("aten::mm", "aten::addmm"), "log_softmax": ("aten::_log_softmax",),
             "mean": ("aten::mean.dim",)}
_pieces_off: frozenset[str] = frozenset()
_TE = "transformer_engine.pytorch"


class BatchInvariantModeError(RuntimeError):
    """Batch-invariant mode could not be entered; nothing was left enabled."""


def _checked(pieces: Iterable[str]) -> frozenset[str]:
    pieces = frozenset(pieces)
    if unknown := sorted(pieces - PIECES.keys()):
        raise ValueError(f"unknown batch-invariant pieces {unknown}: expected some of {sorted(PIECES)}")
    return pieces


def enabled(piece: str | None = None) -> bool:
    """The switch is on (and, given a piece of PIECES, that piece is not left off)."""
    on = _mcore_bik.is_batch_invariant_mode_enabled()
    if piece is None:
        return on
    _checked([piece])
    return on and piece not in _pieces_off


def left_off(piece: str) -> bool:
    """The switch is on with `piece` off: for pieces whose stock counterpart is not the default
    mode's (flash_version, fp32_logits), which keeps them."""
    return enabled() and not enabled(piece)


def _leave_aten_ops_off(pieces: frozenset[str]) -> None:
    """megatron-core's aten library again, without the ops of `pieces` (their stock kernels run)."""
    off = {op for piece in pieces & _ATEN_OPS.keys() for op in _ATEN_OPS[piece]}
    if not off:
        return
    kernels = {"aten::mm": _mcore_bik.mm_batch_invariant, "aten::addmm": _mcore_bik.addmm_batch_invariant,
               "aten::_log_softmax": _mcore_bik._log_softmax_batch_invariant,
               "aten::mean.dim": _mcore_bik.mean_batch_invariant}
    dispatch_key = getattr(torch.accelerator.current_accelerator(), "type", "cpu").upper()  # as megatron-core
    _mcore_bik._batch_invariant_LIB._destroy()
    library = torch.library.Library("aten", "IMPL")
    for op, kernel in kernels.items():
        if op not in off:
            library.impl(op, kernel, dispatch_key)
    _mcore_bik._batch_invariant_LIB = library  # megatron-core's disable destroys it


def _te_originals(pieces: frozenset[str]) -> list[tuple[object, str, object]]:
    """(owner, attribute, TE's own function) of each TE entry point megatron-core patched for a
    piece of `pieces`, from the originals it keeps to restore them."""
    module, entries = sys.modules.get, []
    if "gemm" in pieces:
        entries += [(module(f"{_TE}.cpp_extensions"), "general_gemm", _mcore_bik._TE_GENERAL_GEMM_ORIG),
                    (module("megatron.core.extensions.transformer_engine"), "general_gemm",
                     _mcore_bik._MEG_TE_GENERAL_GEMM_ORIG)]
        entries += [(module(f"{_TE}.{key.removesuffix('.general_gemm')}"), "general_gemm", original)
                    for key, original in _mcore_bik._TE_GEMM_FUNC_ORIGS.items()]
    if "te_norm" in pieces:
        entries += [(module(f"{_TE}.module.layernorm"), name, original)
                    for name, original in _mcore_bik._TE_RMSNORM_FUNC_ORIGS.items()]
        entries += [(module(f"{_TE}.{key.removesuffix('.apply_normalization')}"), "apply_normalization", original)
                    for key, original in _mcore_bik._TE_APPLY_NORM_ORIGS.items()]
        entries.append((getattr(module(_TE), "RMSNorm", None), "forward", _mcore_bik._TE_RMSNORM_ORIG_FWD))
    return [(owner, attribute, original) for owner, attribute, original in entries
            if owner is not None and original is not None]


def _leave_te_patches_off(pieces: frozenset[str]) -> None:
    """TE's own functions back where megatron-core patched them for `pieces` (its disable
    restores the same ones)."""
    for owner, attribute, original in _te_originals(pieces):
        setattr(owner, attribute, original)


def enable(without: Iterable[str] = ()) -> None:
    """On, with every piece but those `without` (names of PIECES: the doctor's ablation)."""
    global _pieces_off
    without = _checked(without)
    if enabled():
        if without != _pieces_off:
            raise ValueError(f"the switch is on with {sorted(_pieces_off)} off: disable it before "
                             f"enabling with {sorted(without)} off")
        return
    try:
        for name, kernel in _OURS.items():
            setattr(_mcore_bik, name, kernel)
        with compat.transformer_engine_optional():
            _mcore_bik.enable_batch_invariant_mode()
        _leave_aten_ops_off(without)
        _leave_te_patches_off(without)
        embedding.install()
        autotune.install()
        _pieces_off = without
    except Exception as exc:
        disable()
        raise BatchInvariantModeError(
            f"could not enable batch-invariant mode ({type(exc).__name__}: {exc}); "
            "every override was rolled back"
        ) from exc


def disable() -> None:
    global _pieces_off
    _pieces_off = frozenset()
    autotune.uninstall()
    embedding.uninstall()
    _mcore_bik.disable_batch_invariant_mode()
    for name, kernel in _UPSTREAM.items():
        setattr(_mcore_bik, name, kernel)


def _set(on: bool, without: frozenset[str]) -> None:
    if enabled() and (not on or without != _pieces_off):
        disable()
    if on:
        enable(without)


@contextlib.contextmanager
def batch_invariant(on: bool = True, without: Iterable[str] = ()) -> Iterator[None]:
    """Runs the block with the switch set to `on` (with the pieces `without` off), then restores
    the previous state."""
    was = enabled(), _pieces_off
    _set(on, _checked(without))
    try:
        yield
    finally:
        _set(*was)
