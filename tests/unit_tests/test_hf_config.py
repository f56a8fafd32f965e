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
