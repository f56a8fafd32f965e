"""bench/generation_floor.py's bytes and seconds by hand (it reads a run's records: no GPU)."""

import json
import os
import subprocess
import sys

import pytest

from bench import generation_floor

from .. import REPO

GIB = 2**30


def _config(pattern=None, untied=False):
    return {"num_layers": "4", "hidden_size": "4", "num_query_groups": "2", "kv_channels": "4",
            "padded_vocab_size": "8", "untie_embeddings_and_output_weights": str(untied),
            "hybrid_layer_pattern": str(pattern), "linear_num_value_heads": "2", "linear_key_head_dim": "3",
            "linear_value_head_dim": "5"}


def _run(config):
    return {"device": "NVIDIA H200", "git_commit": "0" * 40, "config": config,
            "memory_plan": {"weights": 1.0, "requests_at_once": 4}}


def test_the_context_reads_floor_is_that_of_responses_of_the_mean_length():
    # two responses of 3 tokens read 0 + 1 + 2 earlier tokens each: 6; of 2 and 4 tokens, 1 + 6 = 7
    assert generation_floor.context_reads_floor(2, 6) == 6.0
    assert generation_floor.context_reads_floor(2, 6) <= 1 + 6
    assert generation_floor.decode_steps_floor(10, 4) == 3
    assert generation_floor.decode_steps_floor(8, 4) == 2


def test_a_gpt_models_units_by_hand():
    # every layer attention: 4 x K and V x 2 groups x 4 channels x 2 B; tied: the weights as planned
    assert generation_floor.read_bytes_per_step_unit(_run(_config())) == {
        "weights_per_decode_step": GIB, "kv_per_context_token": 128, "gdn_state_per_token": 0}
    # untied: the input embedding (8 x 4 x 2 B) not read by a decode step
    assert generation_floor.read_bytes_per_step_unit(_run(_config(untied=True)))["weights_per_decode_step"] == GIB - 64


def test_a_hybrid_models_units_by_hand():
    # "G*G-": one attention layer (2 x 2 x 4 x 2 B) and two GDN layers (2 x 3 x 5 fp32, read and written)
    units = generation_floor.read_bytes_per_step_unit(_run(_config("G*G-")))
    assert units["kv_per_context_token"] == 32
    assert units["gdn_state_per_token"] == 2 * (2 * 3 * 5) * 4 * 2


def test_a_steps_floor_and_what_a_target_asks_by_hand():
    units = {"weights_per_decode_step": 100, "kv_per_context_token": 10, "gdn_state_per_token": 1}
    record = {"step": 1, "rollouts/generated": 2, "bit_wise/tokens": 6, "time/generation_s": 4.0,
              "time/training_s": 3.0}
    row = generation_floor.step_floor(units, 4, record, copy_bytes_per_s=10.0, target_step_s=5.0)
    # 2 decode steps x 100 B, 6 earlier tokens x 10 B, 6 tokens x 1 B: 266 B at 10 B/s
    assert row["decode_steps_floor"] == 2
    assert row["floor_bytes"] == {"weights": 200, "kv_cache": 60.0, "gdn_states": 6}
    assert row["floor_s"] == pytest.approx(26.6)
    assert row["generation_floor_fraction"] == pytest.approx(26.6 / 4.0)
    # a 5 s step with 3 s of training leaves the generation 2 s
    assert row["target_generation_s"] == 2.0 and row["target_floor_fraction"] == pytest.approx(13.3)
    assert generation_floor.step_floor(units, 4, record, 10.0, target_step_s=3.0)["target_floor_fraction"] is None
    assert "target_generation_s" not in generation_floor.step_floor(units, 4, record, 10.0, None)


def test_the_report_of_a_metrics_file(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    step = {"step": 1, "rollouts/generated": 2, "bit_wise/tokens": 6, "time/generation_s": 4.0,
            "time/training_s": 3.0}
    metrics.write_text(json.dumps({"run": _run(_config())}) + "\n" + json.dumps(step) + "\n")
    output = tmp_path / "floor.json"
    done = subprocess.run([sys.executable, os.path.join(REPO, "bench", "generation_floor.py"), str(metrics),
                           "--copy-bytes-per-s", "1e9", "--output", str(output)],
                          capture_output=True, text=True, cwd=REPO)
    assert done.returncode == 0, done.stderr
    report = json.loads(output.read_text())
    assert report["requests_at_once"] == 4 and report["run_device"] == "NVIDIA H200" and "source_hash" in report
    # 2 steps x 1 GiB + 6 x 128 B at 1e9 B/s
    assert report["steps"][0]["floor_s"] == pytest.approx((2 * GIB + 6 * 128) / 1e9)
    assert "step 1: generation 4 s, its floor 2 s" in done.stdout


def test_a_moe_model_has_no_floor_from_its_planned_weights():
    with pytest.raises(ValueError, match="MoE"):
        generation_floor.read_bytes_per_step_unit(_run({**_config(), "num_moe_experts": "8"}))
    assert generation_floor.read_bytes_per_step_unit(_run({**_config(), "num_moe_experts": "None"}))


def test_a_file_without_a_planned_run_header_is_an_error(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text(json.dumps({"run": {"device": "x"}}) + "\n")
    with pytest.raises(ValueError, match="no run header with a memory plan"):
        generation_floor.header(str(metrics))
