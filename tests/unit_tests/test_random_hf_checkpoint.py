"""tools/random_hf_checkpoint.py's depth override (CPU): the published widths at fewer layers,
the hybrid's pattern kept, a depth that splits a hybrid group refused."""

import importlib.util
import json
import os
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _tool():
    path = os.path.join(REPO, "tools", "random_hf_checkpoint.py")
    spec = importlib.util.spec_from_file_location("random_hf_checkpoint", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_qwen35_widths_at_eight_layers_keep_every_fourth_layer_attention(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["random_hf_checkpoint.py", "qwen3.5-9b", str(tmp_path),
                                      "--config-only", "--num-hidden-layers", "8"])
    _tool().main()
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
