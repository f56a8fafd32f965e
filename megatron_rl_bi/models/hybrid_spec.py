"""Hybrid (Qwen3.5-style) stack: GDN, attention, MLP and MoE layers in the order of megatron-core's
`hybrid_layer_pattern` ('G' GDN, '*' attention, '-' MLP, 'E' mixture of experts; e.g. "G-G-G-*-"
is 3 GDN : 1 attention, each followed by an MLP; "GEGE*E" the same with MoE layers, models.moe).

The layer structure is megatron-core's HybridStack spec; only kernels change: FlashCoreAttention
for attention, SwitchedGatedDeltaNet for GDN, and either local linears with models.norm.RMSNorm
(BI under the switch) for every norm, or, with --transformer-impl transformer_engine, TE's
linears with each layer's input norm fused into its first linear (as megatron-core's TE hybrid
spec has it; its BI mode patches TE's GEMM and norms) and TE's norm for QK norms.

Departure from megatron-core: GDN's gated output norm is models.norm.RMSNorm in both variants
and scales by its weight, never by 1 + weight, whatever --apply-layernorm-1p says (megatron-core
follows the flag there). That is Qwen3.5's gated norm, so its weights load bit for bit; a
zero-centred copy would round weights below 0.5.
"""

from dataclasses import dataclass
from functools import partial

from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.models.hybrid.hybrid_block import HybridStack, HybridStackSubmodules
from megatron.core.ssm.gated_delta_net import GatedDeltaNetSubmodules
from megatron.core.ssm.mlp_layer import MLPLayer
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_layer import (
    MoETransformerLayer,
    TransformerLayer,
    TransformerLayerSubmodules,
)

from megatron_rl_bi.attention import FlashCoreAttention
from megatron_rl_bi.models.gdn import SwitchedGatedDeltaNet
from megatron_rl_bi.models.gpt_spec import check_transformer_impl
from megatron_rl_bi.models.moe import moe_mlp
from megatron_rl_bi.models.norm import RMSNorm


@dataclass(frozen=True)
class _Kernels:
    input_norm: type  # a layer's norm before its first linear (IdentityOp when fused into it)
    first_linear: type  # in_proj, linear_qkv, linear_fc1
    last_linear: type  # out_proj, linear_proj, linear_fc2
    qk_norm: type
    norm: type  # a norm on its own (before a MoE layer's router and experts)
    expert_linears: tuple[type, type]  # an expert's fc1 and fc2


def _kernels(transformer_impl: str) -> _Kernels:
    check_transformer_impl(transformer_impl)
    if transformer_impl == "local":
        return _Kernels(RMSNorm, ColumnParallelLinear, RowParallelLinear, RMSNorm, RMSNorm,
                        (ColumnParallelLinear, RowParallelLinear))
    from megatron.core.extensions.transformer_engine import (
        TEColumnParallelLinear,
        TELayerNormColumnParallelLinear,
        TENorm,
        TERowParallelLinear,
    )

    return _Kernels(IdentityOp, TELayerNormColumnParallelLinear, TERowParallelLinear, TENorm, TENorm,
                    (TEColumnParallelLinear, TERowParallelLinear))


def hybrid_stack_spec(transformer_impl: str, qk_layernorm: bool = False) -> ModuleSpec:
    """transformer_impl: 'local' or 'transformer_engine' (Megatron's --transformer-impl)."""
    k = _kernels(transformer_impl)
    gdn_layer = ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=k.input_norm,
            self_attention=ModuleSpec(
                module=SwitchedGatedDeltaNet,
                submodules=GatedDeltaNetSubmodules(
                    in_proj=k.first_linear,
                    out_norm=ModuleSpec(module=RMSNorm, params={"zero_centered_gamma": False}),
                    out_proj=k.last_linear,
                ),
            ),
            self_attn_bda=get_bias_dropout_add,
        ),
    )
    attention_layer = ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=k.input_norm,
            self_attention=ModuleSpec(
                module=SelfAttention,
                params={"attn_mask_type": AttnMaskType.causal},
                submodules=SelfAttentionSubmodules(
                    linear_qkv=k.first_linear,
                    core_attention=FlashCoreAttention,
                    linear_proj=k.last_linear,
                    q_layernorm=k.qk_norm if qk_layernorm else None,
                    k_layernorm=k.qk_norm if qk_layernorm else None,
                ),
            ),
            self_attn_bda=get_bias_dropout_add,
        ),
    )
    mlp_layer = ModuleSpec(
        module=MLPLayer,
        submodules=TransformerLayerSubmodules(
            pre_mlp_layernorm=k.input_norm,
            mlp=partial(
                MLP.as_mlp_submodule,
                submodules=MLPSubmodules(linear_fc1=k.first_linear, linear_fc2=k.last_linear),
            ),
            mlp_bda=get_bias_dropout_add,
        ),
    )
    moe_layer = ModuleSpec(
        module=MoETransformerLayer,
        submodules=TransformerLayerSubmodules(
            pre_mlp_layernorm=k.norm, mlp=moe_mlp(*k.expert_linears), mlp_bda=get_bias_dropout_add
        ),
    )
    return ModuleSpec(
        module=HybridStack,
        submodules=HybridStackSubmodules(
            gdn_layer=gdn_layer, attention_layer=attention_layer, mlp_layer=mlp_layer,
            moe_layer=moe_layer,
        ),
    )
