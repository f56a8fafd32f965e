"""config.json -> Megatron flags on CPU: a missing or malformed size names the file and the key
(the nested Qwen3.5 layout's key as text_config.KEY), and Qwen3.5's layer_types must cover every
layer; hand-written configs."""

import json

import pytest

from megatron_rl_bi.checkpoints.hf.config import megatron_flags, read_hf_model

QWEN3 = {"model_type": "qwen3", "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 256, "rms_norm_eps": 1e-6,
         "rope_theta": 1000000, "vocab_size": 100, "num_hidden_layers": 2}
QWEN3_5 = {**QWEN3, "model_type": "qwen3_5_text", "num_hidden_layers": 4, "linear_num_key_heads": 2,
           "linear_num_value_heads": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
           "linear_conv_kernel_dim": 4}


def _flags(tmp_path, config):
    (tmp_path / "config.json").write_text(json.dumps(config))
    return megatron_flags(read_hf_model(str(tmp_path)))


def test_a_complete_config_gives_the_sizes(tmp_path):
    flags = _flags(tmp_path, QWEN3)
    sizes = ("hidden_size", "num_query_groups", "kv_channels", "num_layers")
    assert [flags[key] for key in sizes] == [64, 2, 16, 2]
    assert _flags(tmp_path, QWEN3_5)["hybrid_layer_pattern"] == "G-G-G-*-"


@pytest.mark.parametrize("key", ["hidden_size", "rms_norm_eps", "num_key_value_heads", "vocab_size",
                                 "intermediate_size", "max_position_embeddings", "num_hidden_layers"])
def test_a_missing_key_is_named(tmp_path, key):
    config = {k: v for k, v in QWEN3.items() if k != key}
    with pytest.raises(ValueError, match=f"{tmp_path}/config.json: missing key '{key}'"):
        _flags(tmp_path, config)


@pytest.mark.parametrize("key", ["linear_num_key_heads", "linear_conv_kernel_dim"])
def test_a_missing_gdn_key_of_a_nested_config_is_named_under_text_config(tmp_path, key):
    text = {k: v for k, v in QWEN3_5.items() if k != key}
    with pytest.raises(ValueError, match=f"missing key 'text_config.{key}'"):
        _flags(tmp_path, {"model_type": "qwen3_5", "text_config": text})


@pytest.mark.parametrize("value", ["64", 0, -64, 64.0, True, None])
def test_a_size_that_is_not_a_positive_int_is_named(tmp_path, value):
    with pytest.raises(ValueError, match=f"config.json: hidden_size is {value!r}; a positive int is needed"):
        _flags(tmp_path, {**QWEN3, "hidden_size": value})


def test_an_epsilon_may_be_an_int_but_not_a_string(tmp_path):
    assert _flags(tmp_path, {**QWEN3, "rms_norm_eps": 1})["layernorm_epsilon"] == 1
    with pytest.raises(ValueError, match="rms_norm_eps is '1e-6'; a positive float is needed"):
        _flags(tmp_path, {**QWEN3, "rms_norm_eps": "1e-6"})


def test_layer_types_must_cover_every_layer(tmp_path):
    config = {**QWEN3_5, "layer_types": ["linear_attention", "full_attention"]}
    with pytest.raises(ValueError, match="config.json: 2 layer_types for num_hidden_layers 4"):
        _flags(tmp_path, config)


QWEN3_MOE = {**QWEN3, "model_type": "qwen3_moe", "num_hidden_layers": 6, "num_experts": 8,
             "num_experts_per_tok": 2, "moe_intermediate_size": 32, "decoder_sparse_step": 2,
             "mlp_only_layers": [3], "norm_topk_prob": True}


def test_qwen3_moe_layers_router_and_sizes_by_hand(tmp_path):
    """Every 2nd layer counting from 1 has experts (1, 3, 5), less layer 3 (`mlp_only_layers`);
    a normalized top-k is the softmax over the top k logits (no pre-softmax)."""
    flags = _flags(tmp_path, QWEN3_MOE)
    assert flags["moe_layer_freq"] == [0, 1, 0, 0, 0, 1]
    assert (flags["num_experts"], flags["moe_router_topk"], flags["moe_ffn_hidden_size"]) == (8, 2, 32)
    assert flags["moe_router_pre_softmax"] is False and flags["ffn_hidden_size"] == 128
    # transformers 5 writes num_local_experts; without norm_topk_prob its default, False
    config = {k: v for k, v in QWEN3_MOE.items() if k not in ("num_experts", "norm_topk_prob", "decoder_sparse_step")}
    flags = _flags(tmp_path, {**config, "num_local_experts": 4})
    assert flags["num_experts"] == 4 and flags["moe_router_pre_softmax"] is True
    assert flags["moe_layer_freq"] == [1, 1, 1, 0, 1, 1]


@pytest.mark.parametrize("config, problem", [
    ({**QWEN3_MOE, "shared_expert_intermediate_size": 64}, "shared_expert_intermediate_size .a shared expert."),
    ({**QWEN3, "num_experts": 8}, "a mixture of experts .num_experts. outside Qwen3-MoE"),
    ({**QWEN3_5, "num_experts": 8}, "a mixture of experts .num_experts. outside Qwen3-MoE and Qwen3.5-MoE"),
    # Qwen3.5-MoE without its experts' sizes
    ({**QWEN3_5, "model_type": "qwen3_5_moe_text"}, "missing key 'moe_intermediate_size'"),
])
def test_moe_the_mapping_does_not_cover_is_refused_naming_the_key(tmp_path, config, problem):
    with pytest.raises(ValueError, match=problem):
        _flags(tmp_path, config)
