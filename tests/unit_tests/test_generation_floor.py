"""bench/generation_floor.py's bytes and seconds by hand (it reads a run's records: no GPU)."""

import json
import os
import subprocess
import sys

import pytest

from bench import generation_floor
from megatron_rl_bi.config import parse_rl_args
from megatron_rl_bi.reporting.metrics import read_run_header

from .. import REPO

GIB = 2**30


COMMON = ["--seq-length", "64", "--max-position-embeddings", "64", "--use-cpu-initialization",
          "--transformer-impl", "local", "--hidden-size", "4", "--ffn-hidden-size", "8", "--num-attention-heads", "2",
          "--group-query-attention", "--num-query-groups", "1", "--kv-channels", "2", "--swiglu",
          "--disable-bias-linear", "--bf16"]
GDN = ["--linear-num-key-heads", "1", "--linear-num-value-heads", "2", "--linear-key-head-dim", "2",
       "--linear-value-head-dim", "2", "--linear-conv-kernel-dim", "4"]


def _run(*flags):
    """A run header as pretrain_rl.py writes it: every flag as str(), Megatron's padded vocabulary."""
    args = parse_rl_args(COMMON + list(flags))
    config = {name: str(value) for name, value in vars(args).items()}
    return {"device": "NVIDIA H200", "git_commit": "0" * 40, "config": {**config, "padded_vocab_size": "128"},
            "memory_plan": {"requests_at_once": 4}}


def _floor_tool(metrics, output) -> subprocess.CompletedProcess:
    """bench/generation_floor.py on `metrics` at 10 bytes a second."""
    return subprocess.run([sys.executable, os.path.join(REPO, "bench", "generation_floor.py"), str(metrics),
                           "--copy-bytes-per-s", "10", "--output", str(output)],
                          capture_output=True, text=True, cwd=REPO)


def test_the_context_reads_floor_is_that_of_responses_of_the_mean_length():
    # two responses of 3 tokens read 0 + 1 + 2 earlier tokens each: 6; of 2 and 4 tokens, 1 + 6 = 7
    assert generation_floor.context_reads_floor(2, 6) == 6.0
    assert generation_floor.context_reads_floor(2, 6) <= 1 + 6
    assert generation_floor.decode_steps_floor(10, 4) == 3
    assert generation_floor.decode_steps_floor(8, 4) == 2


def test_a_gpt_models_units_by_hand():
    # 2 layers of attention (norm 4 + QKV 4 x (4 + 2 x 2) + proj 4 x 4 = 52) and SwiGLU MLP (norm 4 +
    # 4 x 16 + 8 x 4 = 100), embedding 128 x 4, final norm 4: 820 parameters of 2 B, tied
    units = generation_floor.read_bytes_per_step_unit(_run("--num-layers", "2"))
    # KV: 2 layers x K and V x 1 group x 2 channels x 2 B
    assert units == {"weights_per_decode_step": 820 * 2, "kv_per_context_token": 16, "gdn_state_per_token": 0}
    # untied: an output layer more (512), the input embedding (512) not read by a decode step
    untied = _run("--num-layers", "2", "--untie-embeddings-and-output-weights")
    assert generation_floor.read_bytes_per_step_unit(untied)["weights_per_decode_step"] == (820 + 512 - 512) * 2


def test_a_hybrid_models_units_by_hand():
    # "G*G-": one attention layer (2 x 1 x 2 x 2 B); two GDN layers, each request's conv state
    # (2 x 2 + 4) x 4 x 2 B = 64 and rule state 2 heads x 2 x 2 fp32 = 32, read and written
    units = generation_floor.read_bytes_per_step_unit(_run("--hybrid-layer-pattern", "G*G-", *GDN))
    assert units["kv_per_context_token"] == 8
    assert units["gdn_state_per_token"] == 2 * (64 + 32) * 2


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
    metrics.write_text(json.dumps({"run": _run("--num-layers", "2")}) + "\n" + json.dumps(step) + "\n")
    output = tmp_path / "floor.json"
    done = _floor_tool(metrics, output)
    assert done.returncode == 0, done.stderr
    report = json.loads(output.read_text())
    assert report["requests_at_once"] == 4 and report["run_device"] == "NVIDIA H200" and "source_hash" in report
    # 2 steps x 1,640 B + 6 x 16 B at 10 B/s
    assert report["steps"][0]["floor_s"] == pytest.approx((2 * 1640 + 6 * 16) / 10)
    assert "step 1: generation 4 s, its floor 338 s" in done.stdout


def test_a_moe_model_has_no_floor_from_its_planned_weights():
    with pytest.raises(ValueError, match="MoE"):
        generation_floor.read_bytes_per_step_unit(_run("--num-layers", "2", "--num-experts", "4"))
    # the MoE run measured at size
    measured = read_run_header(f"{REPO}/results/rl_qwen3_30b_a3b_8layers_h200.jsonl")
    with pytest.raises(ValueError, match="MoE"):
        generation_floor.read_bytes_per_step_unit(measured)


# a measured run's file: the bytes of its input embedding when untied (Qwen3.5-9B: 248,320 x 4,096 bf16)
MEASURED = {"rl_qwen3_4b_8k_h200_fused_rope.jsonl": 0,
            "rl_qwen35_9b_8k_h200_8layers_fla_backward.jsonl": 248_320 * 4_096 * 2}


@pytest.mark.parametrize("name", MEASURED)
def test_a_measured_runs_header_gives_back_the_weights_it_planned(name):
    run = read_run_header(f"{REPO}/results/{name}")
    units = generation_floor.read_bytes_per_step_unit(run)
    assert units["weights_per_decode_step"] == run["memory_plan"]["weights"] * GIB - MEASURED[name]


def test_a_file_without_a_planned_run_header_is_an_error(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text(json.dumps({"run": {"device": "x", "config": {}}}) + "\n" + json.dumps({"step": 1}) + "\n")
    done = _floor_tool(metrics, tmp_path / "floor.json")
    assert done.returncode != 0 and "its run header has no memory plan" in done.stderr
