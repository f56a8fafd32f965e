"""Core attention for training that runs the FlashAttention generation the engine runs."""

from megatron_rl_bi.attention.flash import FlashCoreAttention, fa3_missing_head_dim, flash_varlen_function

__all__ = ["FlashCoreAttention", "fa3_missing_head_dim", "flash_varlen_function"]
