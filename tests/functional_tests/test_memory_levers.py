"""The main job with each memory lever on (GPU): 20 steps of examples/recipes/tiny_sort.yaml in
BI mode must repeat the published run (results/rl_tiny_h200.jsonl) in every value that is not a
measurement of the machine: the levers move state between memories or recompute it with the
same kernels, which changes no bit. Two levers change the optimizer's arithmetic, so the
updates round differently and the run is another (seen on the H200 for the first: step 1
already differs): the distributed optimizer (its gradient norm and Adam over one flat shard, not
per parameter) and the optimizer on the CPU (torch's CPU Adam). They must keep parity 0 at every
step instead, as must full recompute beside the engine's CUDA graphs (the Qwen recipes' setting;
decode steps through graphs make it another run too). With the optimizer on the CPU, parking
its GPU state while generating must change no bit of that run."""

import importlib.util
import os
import subprocess
import sys

import pytest

from megatron_rl_bi.reporting.metrics import read_step_records

from .conftest import REPO, TINY_RECIPE

pytestmark = pytest.mark.gpu

_spec = importlib.util.spec_from_file_location("compare_metrics", os.path.join(REPO, "tools", "compare_metrics.py"))
compare_metrics = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(compare_metrics)

STEPS = 20
LEVERS = {
    "recompute full": ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"],
    "recompute selective": ["--recompute-granularity", "selective"],
    "optimizer off the GPU while generating": ["--rl-offload-optimizer-during-inference"],
    "KV cache freed while training": ["--rl-kv-cache-management-mode", "recompute"],
    "KV cache sized from free memory": ["--rl-kv-cache-memory-fraction", "0.5"],
    "the Qwen3 recipe's levers together": [
        "--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1",
        "--rl-offload-optimizer-during-inference", "--rl-kv-cache-management-mode", "recompute",
        "--rl-kv-cache-memory-fraction", "0.5"],
}
# Another run too: the engine's decode steps through CUDA graphs (parity is the claim).
WITH_ENGINE_GRAPHS = {
    "full recompute with the engine's CUDA graphs": [
        "--cuda-graph-impl", "local", "--inference-cuda-graph-scope", "block", "--decode-only-cuda-graphs",
        "--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"],
}
OTHER_ARITHMETIC = {
    "distributed optimizer": ["--use-distributed-optimizer"],
    "optimizer on the CPU": ["--use-distributed-optimizer", "--use-precision-aware-optimizer", "--optimizer-cpu-offload"],
}


def _main_job(tmp_path, flags: list[str]) -> dict[int, dict]:
    metrics = tmp_path / "m.jsonl"
    subprocess.run([sys.executable, os.path.join(REPO, "pretrain_rl.py"), "--recipe", TINY_RECIPE,
                    "--batch-invariant-mode", "--flash-attention-version", "4", "--train-iters", str(STEPS),
                    "--rl-metrics-jsonl", str(metrics), "--save", str(tmp_path / "ckpt"), *flags],
                   check=True, cwd=REPO)
    return read_step_records(str(metrics))


@pytest.mark.parametrize("lever", LEVERS)
def test_the_main_job_repeats_its_published_bits(tmp_path, lever):
    published = read_step_records(os.path.join(REPO, "results", "rl_tiny_h200.jsonl"))
    expected = {step: published[step] for step in range(1, STEPS + 1)}
    assert compare_metrics.differences(expected, _main_job(tmp_path, LEVERS[lever])) == []


@pytest.mark.parametrize("lever", {**OTHER_ARITHMETIC, **WITH_ENGINE_GRAPHS})
def test_another_run_keeps_parity(tmp_path, lever):
    records = _main_job(tmp_path, {**OTHER_ARITHMETIC, **WITH_ENGINE_GRAPHS}[lever])
    assert sorted(records) == list(range(1, STEPS + 1))
    for record in records.values():
        assert record["bit_wise/logprob_diff/max"] == 0.0 and record["bit_wise/ratio_tokens_different"] == 0.0


def test_the_optimizer_on_the_cpu_parked_while_generating_repeats_it_kept(tmp_path):
    # The Qwen3.5 recipe's one-GPU route: the main weights on the CPU and the optimizer's GPU state
    # parked while generating. Parking moves no bit, so both runs are one; a parked shard of the
    # weights' own buffer once took the updates into a copy, and the model stopped learning.
    on_cpu = OTHER_ARITHMETIC["optimizer on the CPU"]
    (tmp_path / "kept").mkdir()
    (tmp_path / "parked").mkdir()
    kept = _main_job(tmp_path / "kept", on_cpu)
    parked = _main_job(tmp_path / "parked", [*on_cpu, "--rl-offload-optimizer-during-inference"])
    assert compare_metrics.differences(kept, parked) == []
