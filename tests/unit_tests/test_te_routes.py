"""The TransformerEngine route's CPU-checkable parts: checkpoint names of TE's fused norm+linear
layers (attention, GDN and MLP layers of a hybrid model), and the hybrid spec's choice of
kernels (TE itself runs on the H200 only)."""

import pytest

from megatron_rl_bi import compat
from megatron_rl_bi.checkpoints.hf import _megatron_key
from megatron_rl_bi.checkpoints.hf.mapping import Rule
from megatron_rl_bi.models import gpt_spec, hybrid_spec

TE_STATE = {
    "decoder.layers.0.self_attention.in_proj.layer_norm_weight": None,  # GDN
    "decoder.layers.1.mlp.linear_fc1.layer_norm_weight": None,  # MLP
    "decoder.layers.2.self_attention.linear_qkv.layer_norm_weight": None,  # attention
    "decoder.layers.2.self_attention.q_layernorm.weight": None,
}


@pytest.mark.parametrize("local,te", [
    ("decoder.layers.0.input_layernorm.weight", "decoder.layers.0.self_attention.in_proj.layer_norm_weight"),
    ("decoder.layers.1.pre_mlp_layernorm.weight", "decoder.layers.1.mlp.linear_fc1.layer_norm_weight"),
    ("decoder.layers.2.input_layernorm.weight",
     "decoder.layers.2.self_attention.linear_qkv.layer_norm_weight"),
    ("decoder.layers.2.self_attention.q_layernorm.weight", "decoder.layers.2.self_attention.q_layernorm.weight"),
])
def test_local_names_find_their_te_parameters(local, te):
    assert _megatron_key(Rule(local, ("hf",)), TE_STATE) == te


def test_a_parameter_the_model_lacks_is_named():
    with pytest.raises(ValueError, match="no parameter 'decoder.layers.3.input_layernorm.weight'"):
        _megatron_key(Rule("decoder.layers.3.input_layernorm.weight", ("hf",)), TE_STATE)


def test_hybrid_spec_kernels(monkeypatch):
    local = hybrid_spec._kernels("local")
    assert (local.input_norm, local.first_linear.__name__) == (hybrid_spec.RMSNorm, "ColumnParallelLinear")
    with pytest.raises(ValueError, match="--transformer-impl fused: expected local or transformer_engine"):
        hybrid_spec._kernels("fused")
    monkeypatch.setattr(compat, "transformer_engine_installed", lambda: False)
    for spec in (hybrid_spec.hybrid_stack_spec, gpt_spec.dense_gpt_layer_spec):
        with pytest.raises(ImportError, match="--transformer-impl transformer_engine needs TransformerEngine"):
            spec("transformer_engine")
