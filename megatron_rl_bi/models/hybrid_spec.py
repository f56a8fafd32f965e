"""Hybrid (Qwen3.5-style) stack without TransformerEngine: GDN, attention and MLP layers in the
order of megatron-core's `hybrid_layer_pattern` ('G' GDN, '*' attention, '-' MLP; e.g.
"G-G-G-*-" is 3 GDN : 1 attention, each followed by an MLP).

The layer structure is megatron-core's HybridStack spec; only kernels change: local linears,
models.norm.RMSNorm (BI under the switch) for every norm including GDN's gated output norm,
FlashCoreAttention for attention, SwitchedGatedDeltaNet for GDN.

Departure from megatron-core: GDN's gated output norm scales by its weight, never by
1 + weight, whatever --apply-layernorm-1p says (megatron-core follows the flag there). That is
Qwen3.5's gated norm, so its weights load bit for bit; a zero-centred copy would round weights
below 0.5.
"""

from functools import partial

from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.models.hybrid.hybrid_block import HybridStack, HybridStackSubmodules
from megatron.core.ssm.gated_delta_net import GatedDeltaNetSubmodules
from megatron.core.ssm.mlp_layer import MLPLayer
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

from megatron_rl_bi.attention import FlashCoreAttention
from megatron_rl_bi.models.gdn import SwitchedGatedDeltaNet
from megatron_rl_bi.models.norm import RMSNorm


def local_hybrid_stack_spec(qk_layernorm: bool = False) -> ModuleSpec:
    gdn_layer = ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=RMSNorm,
            self_attention=ModuleSpec(
                module=SwitchedGatedDeltaNet,
                submodules=GatedDeltaNetSubmodules(
                    in_proj=ColumnParallelLinear,
                    out_norm=ModuleSpec(module=RMSNorm, params={"zero_centered_gamma": False}),
                    out_proj=RowParallelLinear,
                ),
            ),
            self_attn_bda=get_bias_dropout_add,
        ),
    )
    attention_layer = ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=RMSNorm,
            self_attention=ModuleSpec(
                module=SelfAttention,
                params={"attn_mask_type": AttnMaskType.causal},
                submodules=SelfAttentionSubmodules(
                    linear_qkv=ColumnParallelLinear,
                    core_attention=FlashCoreAttention,
                    linear_proj=RowParallelLinear,
                    q_layernorm=RMSNorm if qk_layernorm else None,
                    k_layernorm=RMSNorm if qk_layernorm else None,
                ),
            ),
            self_attn_bda=get_bias_dropout_add,
        ),
    )
    mlp_layer = ModuleSpec(
        module=MLPLayer,
        submodules=TransformerLayerSubmodules(
            pre_mlp_layernorm=RMSNorm,
            mlp=partial(
                MLP.as_mlp_submodule,
                submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear),
            ),
            mlp_bda=get_bias_dropout_add,
        ),
    )
    return ModuleSpec(
        module=HybridStack,
        submodules=HybridStackSubmodules(
            gdn_layer=gdn_layer, attention_layer=attention_layer, mlp_layer=mlp_layer
        ),
    )
