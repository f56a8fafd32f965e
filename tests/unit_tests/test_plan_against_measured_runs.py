"""The planner as it is now against every RL run measured on the H200 (CPU): each run's flags
planned again (published configurations written without weights by
tools/random_hf_checkpoint.py --config-only) on the run's own GPU memory, and each peak its steps
recorded (generating, training, the whole run) within 10 % of the plan's. A change to the planner
that would mispredict a measured run fails here, not on the next GPU run.

Left out: rl_qwen35_9b_8k_h200_8layers.jsonl (affeaae), whose recorded peak came from an order of
its start fixed since (docs/sizing.md); its rerun with the fix, the _fla_backward file, is in."""

import importlib.util
import json
import subprocess
import sys

import pytest

from megatron_rl_bi.config import parse_rl_args
from megatron_rl_bi.config.from_args import levers_from_args, memory_run_from_args
from megatron_rl_bi.memory import GIB, plan_memory
from megatron_rl_bi.reporting.metrics import read_step_records

from .. import REPO
from .example_scripts import pretrain_rl_flags

_spec = importlib.util.spec_from_file_location("memory_plan", f"{REPO}/tools/memory_plan.py")
memory_plan = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(memory_plan)

# the MoE run's flags after rl_at_size.sh's arguments (results/README.md)
MOE_AT_WIDTH = ("--cuda-graph-impl", "none", "--inference-cuda-graph-scope", "none",
                "--inference-dynamic-batching-async-sched-mode", "legacy", "--moe-enable-routing-replay",
                "--rl-max-new-tokens", "512", "--rl-overlong-buffer", "128",
                "--inference-dynamic-batching-max-requests", "128")
# result file: (the examples/ script and arguments that made it (results/README.md), or None for
# the flags beside it; its published configuration (None: the recipe's model); that config's layers)
RUNS = {
    "rl_qwen3_4b_8k_h200.jsonl": (("rl_at_size.sh", "qwen3-4b", "3"), "qwen3-4b", None),
    "rl_qwen3_4b_8k_h200_fused_rope.jsonl": (("rl_at_size.sh", "qwen3-4b", "2"), "qwen3-4b", None),
    "rl_qwen35_9b_8k_h200_8layers_fla_backward.jsonl": (("rl_at_size.sh", "qwen3.5-9b", "3", "8"), "qwen3.5-9b", 8),
    "rl_qwen35_9b_8k_h200_8layers_gdn_kernel.jsonl": (("rl_at_size.sh", "qwen3.5-9b", "2", "8"), "qwen3.5-9b", 8),
    "rl_qwen3_30b_a3b_8layers_h200.jsonl": (("rl_at_size.sh", "qwen3-30b-a3b", "2", "8", *MOE_AT_WIDTH), "qwen3-30b-a3b", 8),
    "rl_qwen3_terminal_h200.jsonl": (("rl_agent_hf.sh", "terminal", "qwen3-0.6b", "3"), "qwen3-0.6b", None),
    "rl_qwen3_search_h200.jsonl": (("rl_agent_hf.sh", "search", "qwen3-0.6b", "5"), "qwen3-0.6b", None),
    "rl_tiny_h200.jsonl": (("rl_tiny.sh",), None, None),
    "rl_tiny_hybrid_h200.jsonl": (None, None, None),  # pretrain_rl.py with the flags below
}
TINY_HYBRID = ["--recipe", "examples/recipes/tiny_sort_hybrid.yaml", "--batch-invariant-mode",
               "--flash-attention-version", "4"]
PHASES = {"peak_generation": "memory/peak_generation_gib", "peak_training": "memory/peak_training_gib",
          "peak": "memory/peak_allocated_gib"}


def _flags(tmp_path, name: str) -> list[str]:
    """The run's pretrain_rl.py flags, with repository paths made absolute and the checkpoint and
    prompts of its published configuration written here without weights."""
    command, preset, layers = RUNS[name]
    flags = pretrain_rl_flags(tmp_path / "script", *command) if command else TINY_HYBRID
    flags = [f"{REPO}/{flag}" if flag.startswith("examples/") else flag for flag in flags]
    if preset is None:
        return flags
    out = tmp_path / preset
    layer_flags = ["--num-hidden-layers", str(layers)] if layers else []
    subprocess.run([sys.executable, f"{REPO}/tools/random_hf_checkpoint.py", preset, str(out), "--config-only",
                    *layer_flags], check=True, capture_output=True)
    written = {"--hf-checkpoint": str(out / "hf"), "--rl-dataset": str(out / "math.jsonl")}
    return [written.get(previous, flag) for previous, flag in zip([None, *flags], flags)]


def _run_header_gpu_gib(path) -> float:
    with open(path) as f:
        return json.loads(f.readline())["run"]["memory_plan"]["gpu"]


@pytest.mark.parametrize("name", RUNS)
def test_the_plan_of_a_measured_runs_flags_is_within_10_percent_of_its_peaks(tmp_path, name):
    path = f"{REPO}/results/{name}"
    args = parse_rl_args(_flags(tmp_path, name))
    run = memory_run_from_args(args, memory_plan.vocab_size(args), 1, int(_run_header_gpu_gib(path) * GIB))
    plan = plan_memory(run, levers_from_args(args)).summary()
    records = read_step_records(path).values()
    compared = 0
    for planned_key, measured_key in PHASES.items():
        measured = [record[measured_key] for record in records if measured_key in record]
        if measured:
            compared += 1
            assert abs(plan[planned_key] / max(measured) - 1) <= 0.10, (planned_key, plan[planned_key], max(measured))
    assert compared >= 1
