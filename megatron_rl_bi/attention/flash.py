"""Training-side core attention over packed (THD) sequences with the pinned FlashAttention.

megatron-core's dynamic engine calls FlashAttention itself (`Attention.flash_decode_and_prefill`:
FA4 `flash_attn.cute.flash_attn_varlen_func`, FA3 `flash_attn_3`, with `num_splits=1` in BI mode).
The local spec's `DotProductAttention` is unfused baddbmm+softmax and rejects THD input, so the
trainer would run a different kernel. This module calls the same generation, version pinned by
`config.flash_attention_version`, with `num_splits=1` whenever the BI switch is on (the library's
default schedule otherwise), and the softmax scale the engine uses (`head_dim ** -0.5`). The
doctor's ablation can leave either off (bi.PIECES: attention_split, flash_version).
"""

import importlib
from collections.abc import Callable
from importlib.metadata import PackageNotFoundError, version

import torch
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_rl_bi import bi
from megatron_rl_bi.packing import uniform_cu_seqlens

_INSTALL_HINT = {
    4: "pip install 'megatron_rl_bi[fa4]' (flash-attn-4==4.0.0b36)",
    3: "build flash_attn_3 from the hopper/ folder of Dao-AILab/flash-attention",
}


def _fa4_varlen() -> Callable:
    try:
        version("flash-attn-4")
    except PackageNotFoundError as exc:
        raise ImportError("flash-attn-4 is not installed") from exc
    return importlib.import_module("flash_attn.cute").flash_attn_varlen_func


def _fa3_varlen() -> Callable:
    # The same two module names megatron-core's attention tries for FA3.
    for module_name in ("flash_attn_3.flash_attn_interface", "flashattn_hopper.flash_attn_interface"):
        try:
            return importlib.import_module(module_name).flash_attn_varlen_func
        except ImportError:
            continue
    raise ImportError("neither flash_attn_3 nor flashattn_hopper is importable")


def flash_varlen_function(flash_attention_version: int) -> Callable:
    """The varlen forward of FlashAttention `flash_attention_version` (3 or 4), or ImportError."""
    loaders = {3: _fa3_varlen, 4: _fa4_varlen}
    if flash_attention_version not in loaders:
        raise ValueError(
            f"--flash-attention-version {flash_attention_version}: training attention supports 3 or 4"
        )
    try:
        return loaders[flash_attention_version]()
    except ImportError as exc:
        raise ImportError(
            f"--flash-attention-version {flash_attention_version} needs FlashAttention-"
            f"{flash_attention_version}: {exc}. Install: {_INSTALL_HINT[flash_attention_version]}"
        ) from exc


OTHER_FLASH_VERSION = {3: 4, 4: 3}  # the doctor's flash_version ablation runs the other one

FA3_HEAD_DIMS = (64, 96, 128, 192, 256)  # FA3 runs a head dim with the kernel of the next one up


def fa3_missing_head_dim(head_dim: int) -> int | None:
    """The FA3 kernel head dim that `head_dim` needs when the installed flash_attn_3 was built
    without it (`FLASHATTENTION_DISABLE_HDIM*`, recorded in the wheel's `flash_attn_config`; a call
    to a missing head dim is expected to crash the process, as a smoke test's did on the H200), else
    None."""
    try:
        build_flags = importlib.import_module("flash_attn_config").CONFIG["build_flags"]
    except (ImportError, AttributeError, KeyError):
        return None  # a build that records no flags
    kernel_dim = next((d for d in FA3_HEAD_DIMS if head_dim <= d), None)
    return kernel_dim if build_flags.get(f"FLASHATTENTION_DISABLE_HDIM{kernel_dim}") else None


class FlashCoreAttention(MegatronModule):
    """Causal self-attention core for THD (packed) or SBHD input, no dropout, no mask tensor."""

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection=None,
    ):
        super().__init__(config=config)
        if attention_type != "self":
            raise ValueError(f"FlashCoreAttention supports self-attention only, got {attention_type}")
        if softmax_scale is not None:
            # The engine ignores config.softmax_scale for GPT attention; so must we, loudly.
            raise ValueError("TransformerConfig.softmax_scale is not supported: the engine uses "
                             "head_dim ** -0.5")
        if (attention_dropout or config.attention_dropout) > 0:
            raise ValueError("--attention-dropout must be 0 with FlashCoreAttention")
        self.version = config.flash_attention_version
        if bi.left_off("flash_version"):  # the ablation: the generation the engine does not run
            self.version = OTHER_FLASH_VERSION.get(self.version, self.version)
        self.varlen = flash_varlen_function(self.version)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type=None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: PackedSeqParams | None = None,
    ) -> torch.Tensor:
        if attention_bias is not None:
            raise ValueError("FlashCoreAttention does not take an attention bias")
        if packed_seq_params is not None:
            # query [T, heads, d], key/value [T, kv_heads, d]
            cu_q, cu_kv = packed_seq_params.cu_seqlens_q, packed_seq_params.cu_seqlens_kv
            max_q, max_kv = packed_seq_params.max_seqlen_q, packed_seq_params.max_seqlen_kv
            out_shape = (query.shape[0], 1, -1)  # [T, 1, heads * d]
        else:
            # query [s, b, heads, d] -> [b * s, heads, d], every sequence of length s
            seq_len, batch = query.shape[:2]
            cu_q = cu_kv = uniform_cu_seqlens(batch, seq_len, query.device)
            max_q = max_kv = seq_len
            query, key, value = (t.transpose(0, 1).flatten(0, 1) for t in (query, key, value))
            out_shape = None
        out = self._varlen(query, key, value, cu_q, cu_kv, max_q, max_kv)  # [T, heads, d]
        if out_shape is not None:
            return out.reshape(out_shape)
        return out.unflatten(0, (batch, seq_len)).transpose(0, 1).flatten(2)  # [s, b, heads * d]

    def _varlen(self, q, k, v, cu_q, cu_kv, max_q, max_kv) -> torch.Tensor:
        common = dict(
            cu_seqlens_q=cu_q,
            cu_seqlens_k=cu_kv,
            max_seqlen_q=max_q,
            max_seqlen_k=max_kv,
            softmax_scale=q.shape[-1] ** -0.5,
            causal=True,
        )
        if bi.enabled("attention_split"):
            common["num_splits"] = 1  # no split-KV: one reduction order per row, as in the engine
        if bi.enabled():
            common["deterministic"] = True  # backward without atomics: runs repeat bit for bit
        result = self.varlen(q, k, v, **common)
        # FA4 returns (out, lse); FA3 returns out, or (out, lse) in some builds.
        return result[0] if isinstance(result, tuple) else result
