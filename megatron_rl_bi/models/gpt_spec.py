"""GPT layer specs: megatron-core's own spec with the kernels parity needs swapped in.

Both variants take megatron-core's layer structure unchanged and only choose kernels:
- core attention -> FlashCoreAttention (the FlashAttention generation the engine calls);
- local (non-TE) norms -> models.norm.RMSNorm (batch-invariant under the switch);
- with --num-experts, the MLP of the layers --moe-layer-freq names -> models.moe's MoE layer.
With TE, TE's linears and norms stay: megatron-core's BI mode patches their GEMM and RMSNorm.
"""

import dataclasses

from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_layer_local_spec,
    get_gpt_layer_with_transformer_engine_spec,
)
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_rl_bi import compat
from megatron_rl_bi.attention import FlashCoreAttention
from megatron_rl_bi.models.moe import moe_mlp
from megatron_rl_bi.models.norm import RMSNorm


def _with_flash_attention(attention: ModuleSpec) -> ModuleSpec:
    submodules = dataclasses.replace(attention.submodules, core_attention=FlashCoreAttention)
    return dataclasses.replace(attention, submodules=submodules)


def check_transformer_impl(transformer_impl: str) -> None:
    """Megatron's --transformer-impl: 'local', or 'transformer_engine' where TE is installed."""
    if transformer_impl not in ("local", "transformer_engine"):
        raise ValueError(f"--transformer-impl {transformer_impl}: expected local or transformer_engine")
    if transformer_impl == "transformer_engine" and not compat.transformer_engine_installed():
        raise ImportError(
            "--transformer-impl transformer_engine needs TransformerEngine: "
            "pip install 'megatron_rl_bi[te]', or pass --transformer-impl local"
        )


def dense_gpt_layer_spec(transformer_impl: str, qk_layernorm: bool = False,
                         moe: bool = False) -> ModuleSpec:
    """transformer_impl: 'local' or 'transformer_engine' (Megatron's --transformer-impl); moe:
    the layer's MLP is a mixture of experts."""
    check_transformer_impl(transformer_impl)
    if transformer_impl == "transformer_engine":
        from megatron.core.extensions.transformer_engine import (
            TEColumnParallelLinear,
            TENorm,
            TERowParallelLinear,
        )

        spec = get_gpt_layer_with_transformer_engine_spec(qk_layernorm=qk_layernorm)
        layer = dataclasses.replace(
            spec.submodules, self_attention=_with_flash_attention(spec.submodules.self_attention)
        )
        if moe:  # the router reads the normed input: the norm is not fused into a linear
            layer = dataclasses.replace(layer, pre_mlp_layernorm=TENorm,
                                        mlp=moe_mlp(TEColumnParallelLinear, TERowParallelLinear))
        return dataclasses.replace(spec, submodules=layer)
    spec = get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=qk_layernorm)
    attention = _with_flash_attention(spec.submodules.self_attention)
    if qk_layernorm:
        attention = dataclasses.replace(
            attention,
            submodules=dataclasses.replace(
                attention.submodules, q_layernorm=RMSNorm, k_layernorm=RMSNorm
            ),
        )
    layer = dataclasses.replace(
        spec.submodules,
        input_layernorm=RMSNorm,
        self_attention=attention,
        pre_mlp_layernorm=RMSNorm,
    )
    if moe:
        layer = dataclasses.replace(layer, mlp=moe_mlp(ColumnParallelLinear, RowParallelLinear))
    return dataclasses.replace(spec, submodules=layer)


def moe_layers(num_layers: int, num_experts: int | None, moe_layer_freq: int | list[int]) -> list[bool]:
    """Which layers are MoE layers: none without --num-experts, else --moe-layer-freq's (N: every
    Nth layer from the first; a list: 1 for MoE, 0 for dense, one entry a layer)."""
    if not num_experts:
        return [False] * num_layers
    if isinstance(moe_layer_freq, int):
        return [i % moe_layer_freq == 0 for i in range(num_layers)]
    if len(moe_layer_freq) != num_layers or set(moe_layer_freq) - {0, 1}:
        raise ValueError(f"--moe-layer-freq {moe_layer_freq}: expected {num_layers} entries of 0 or 1")
    return [bool(f) for f in moe_layer_freq]


def dense_gpt_block_spec(
    config: TransformerConfig, transformer_impl: str, qk_layernorm: bool = False
) -> TransformerBlockSubmodules:
    """All `config.num_layers` layers plus the final norm, which megatron-core would otherwise
    default to its own (unpatched, non-TE) torch norm."""
    layers = [dense_gpt_layer_spec(transformer_impl, qk_layernorm, moe)
              for moe in moe_layers(config.num_layers, config.num_moe_experts, config.moe_layer_freq)]
    if transformer_impl == "transformer_engine":
        from megatron.core.extensions.transformer_engine import TENorm

        final_norm = TENorm
    else:
        final_norm = RMSNorm
    return TransformerBlockSubmodules(layer_specs=layers, layer_norm=final_norm)
