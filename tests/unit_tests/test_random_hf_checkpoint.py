"""tools/random_hf_checkpoint.py's depth override (CPU): the published widths at fewer layers,
the hybrid's pattern kept, a depth that splits a hybrid group refused."""

import importlib.util
import json
import os
import sys

import pytest

from .. import REPO


def _tool():
    path = os.path.join(REPO, "tools", "random_hf_checkpoint.py")
    spec = importlib.util.spec_from_file_location("random_hf_checkpoint", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_qwen35_widths_at_eight_layers_keep_every_fourth_layer_attention(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["random_hf_checkpoint.py", "qwen3.5-9b", str(tmp_path),
                                      "--config-only", "--num-hidden-layers", "8"])
    _tool().main()
    assert capsys.readouterr().out == (f"qwen3.5-9b: {tmp_path / 'hf'} (config and tokenizer, no weights, "
                                       f"8 layers), {tmp_path / 'math.jsonl'} (256 prompts)\n")
    with open(tmp_path / "hf" / "config.json") as f:
        config = json.load(f)
    config = config.get("text_config", config)
    assert config["num_hidden_layers"] == 8 and config["hidden_size"] == 4096 and config["head_dim"] == 256
    assert config["layer_types"] == ["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + ["full_attention"]


@pytest.mark.parametrize("preset, layers", [("qwen3.5-9b", 6), ("qwen3.5-9b", 0), ("qwen3-4b", 0)])
def test_a_depth_that_does_not_fit_the_pattern_is_refused(preset, layers, tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["random_hf_checkpoint.py", preset, str(tmp_path), "--config-only",
                                      "--num-hidden-layers", str(layers)])
    with pytest.raises(SystemExit, match=f"--num-hidden-layers {layers}: .* multiple of"):
        _tool().main()


def test_the_qwen3_30b_a3b_preset_is_the_published_moe_model(tmp_path, monkeypatch):
    """Its config imports as 48 MoE layers of 128 experts, 8 a token, and the planner counts the
    published 30.5B parameters (3.3B of them active: attention, embeddings and 8 experts)."""
    from megatron_rl_bi.config import parse_rl_args
    from megatron_rl_bi.config.from_args import model_shape_from_args
    from megatron_rl_bi.memory import parameter_count

    monkeypatch.setattr(sys, "argv", ["random_hf_checkpoint.py", "qwen3-30b-a3b", str(tmp_path), "--config-only"])
    _tool().main()
    args = parse_rl_args(["--hf-checkpoint", str(tmp_path / "hf"), "--seq-length", "4096",
                          "--transformer-impl", "local", "--flash-attention-version", "4"])
    assert (args.num_layers, args.num_experts, args.moe_router_topk, args.moe_ffn_hidden_size) == (48, 128, 8, 768)
    assert args.moe_layer_freq == [1] * 48 and args.moe_router_pre_softmax is False
    shape = model_shape_from_args(args, args.vocab_size)
    assert round(parameter_count(shape) / 1e9, 1) == 30.5
    active = parameter_count(shape) - 48 * 120 * 3 * 2048 * 768
    assert 3.3e9 <= active < 3.4e9
