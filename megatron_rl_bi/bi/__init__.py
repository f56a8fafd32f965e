"""Batch invariance: the switch and the ops megatron-core lacks on the non-TE path."""

from megatron_rl_bi.bi.ops import rms_norm, sampling_logits, selective_log_softmax
from megatron_rl_bi.bi.switch import (
    PIECES,
    BatchInvariantModeError,
    batch_invariant,
    disable,
    enable,
    enabled,
    left_off,
)

__all__ = [
    "PIECES",
    "BatchInvariantModeError",
    "batch_invariant",
    "disable",
    "enable",
    "enabled",
    "left_off",
    "rms_norm",
    "sampling_logits",
    "selective_log_softmax",
]
