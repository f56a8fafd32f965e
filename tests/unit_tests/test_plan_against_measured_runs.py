"""The planner as it is now against every RL run measured on the H200 (CPU): each run's flags
planned again (published configurations written without weights by
tools/random_hf_checkpoint.py --config-only) on the run's own GPU memory, and each peak its steps
recorded (generating, training, the whole run) within 10 % of the plan's. A change to the planner
that would mispredict a measured run fails here, not on the next GPU run.

Left out: rl_qwen35_9b_8k_h200_8layers.jsonl (affeaae), whose recorded peak came from an order of
its start fixed since (docs/sizing.md); its rerun with the fix, the _fla_backward file, is in."""

import importlib.util
import json
import pathlib
import subprocess
import sys

import pytest

from megatron_rl_bi.config import parse_rl_args
from megatron_rl_bi.config.from_args import levers_from_args, memory_run_from_args
from megatron_rl_bi.memory import GIB, plan_memory
from megatron_rl_bi.reporting.metrics import read_step_records

REPO = pathlib.Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("memory_plan", REPO / "tools" / "memory_plan.py")
memory_plan = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(memory_plan)

RECIPES = REPO / "examples" / "recipes"
AT_SIZE = ["--batch-invariant-mode", "--flash-attention-version", "4", "--save-interval", "0",
           "--save-hf-interval", "0"]  # examples/rl_at_size.sh's flags that size anything
SEARCH = ["--bf16", "--flash-attention-version", "4", "--transformer-impl", "local", "--batch-invariant-mode",
          "--cuda-graph-impl", "local", "--inference-cuda-graph-scope", "block", "--decode-only-cuda-graphs",
          "--rl-task", "lookup", "--rl-env", "search", "--rl-max-turns", "4", "--rl-max-new-tokens", "512",
          "--rl-max-context-tokens", "4096", "--inference-max-seq-length", "4096",
          "--rl-kv-cache-memory-fraction", "0.5", "--grpo-prompts-per-step", "8", "--grpo-group-size", "8",
          "--lr", "1e-6"]  # examples/rl_search_hf.sh's
TINY = ["--batch-invariant-mode", "--flash-attention-version", "4"]
# result file: (published configuration, its layers (None: as published), the run's flags)
RUNS = {
    "rl_qwen3_4b_8k_h200.jsonl": ("qwen3-4b", None, ["--recipe", str(RECIPES / "qwen3_math_dapo.yaml"), *AT_SIZE]),
    "rl_qwen35_9b_8k_h200_8layers_fla_backward.jsonl": (
        "qwen3.5-9b", 8, ["--recipe", str(RECIPES / "qwen35_math_dapo.yaml"), *AT_SIZE]),
    "rl_qwen3_search_h200.jsonl": ("qwen3-0.6b", None, SEARCH),
    "rl_tiny_h200.jsonl": (None, None, ["--recipe", str(RECIPES / "tiny_sort.yaml"), *TINY]),
    "rl_tiny_hybrid_h200.jsonl": (None, None, ["--recipe", str(RECIPES / "tiny_sort_hybrid.yaml"), *TINY]),
}
PHASES = {"peak_generation": "memory/peak_generation_gib", "peak_training": "memory/peak_training_gib",
          "peak": "memory/peak_allocated_gib"}


def _checkpoint_flags(tmp_path, preset: str | None, layers: int | None, flags: list[str]) -> list[str]:
    """--hf-checkpoint of the published configuration, and its prompts where the run reads a dataset."""
    if preset is None:
        return []
    out = tmp_path / preset
    layer_flags = ["--num-hidden-layers", str(layers)] if layers else []
    subprocess.run([sys.executable, str(REPO / "tools" / "random_hf_checkpoint.py"), preset, str(out),
                    "--config-only", *layer_flags], check=True, capture_output=True)
    dataset = ["--rl-dataset", str(out / "math.jsonl")] if "--recipe" in flags else []  # the search task has none
    return ["--hf-checkpoint", str(out / "hf"), *dataset]


def _run_header_gpu_gib(path) -> float:
    with open(path) as f:
        return json.loads(f.readline())["run"]["memory_plan"]["gpu"]


@pytest.mark.parametrize("name", RUNS)
def test_the_plan_of_a_measured_runs_flags_is_within_10_percent_of_its_peaks(tmp_path, name):
    preset, layers, flags = RUNS[name]
    path = REPO / "results" / name
    args = parse_rl_args(flags + _checkpoint_flags(tmp_path, preset, layers, flags))
    run = memory_run_from_args(args, memory_plan.vocab_size(args), 1, int(_run_header_gpu_gib(path) * GIB))
    plan = plan_memory(run, levers_from_args(args)).summary()
    records = read_step_records(str(path)).values()
    compared = 0
    for planned_key, measured_key in PHASES.items():
        measured = [record[measured_key] for record in records if measured_key in record]
        if measured:
            compared += 1
            assert abs(plan[planned_key] / max(measured) - 1) <= 0.10, (planned_key, plan[planned_key], max(measured))
    assert compared >= 1
