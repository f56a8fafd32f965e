"""examples/rl_at_size.sh reads STEPS, then LAYERS only when it is a number, so flags may follow
STEPS (e.g. --rl-generator-ranks 1); run in a copy with `python` and `torchrun` stubbed."""

import pytest

from .example_scripts import run_stubbed


def _run(tmp_path, *args):
    return run_stubbed(tmp_path, "rl_at_size.sh", *args)


def test_flags_right_after_steps_reach_the_run_not_the_checkpoint(tmp_path):
    done, calls = _run(tmp_path, "qwen3-4b", "3", "--rl-generator-ranks", "1")
    assert done.returncode == 0, done.stderr
    assert calls[0] == "python tools/random_hf_checkpoint.py qwen3-4b runs/qwen3-4b_8k"
    assert calls[-1].startswith("torchrun --standalone --nproc-per-node 1 pretrain_rl.py")  # a free port: jobs side by side
    assert calls[-1].split()[-4:-2] == ["--rl-generator-ranks", "1"]
    assert "--train-iters 3" in calls[-1]


def test_layers_as_a_number(tmp_path):
    done, calls = _run(tmp_path, "qwen3.5-9b", "2", "8", "--seed", "7")
    assert done.returncode == 0, done.stderr
    assert calls[0] == "python tools/random_hf_checkpoint.py qwen3.5-9b runs/qwen3.5-9b_8l_8k --num-hidden-layers 8"
    assert "--seed 7" in calls[-1] and "--train-iters 2" in calls[-1]


@pytest.mark.parametrize("args, message", [(("qwen3-4b", "--seed", "7"), "STEPS must be a number, got '--seed'"),
                                           (("llama", "3"), "unknown preset llama")])
def test_bad_arguments_stop_before_any_work(tmp_path, args, message):
    done, calls = _run(tmp_path, *args)
    assert done.returncode == 2 and message in done.stderr and calls == []


def test_default_mode_drops_batch_invariance_and_writes_its_own_run(tmp_path):
    done, calls = run_stubbed(tmp_path / "default", "rl_at_size.sh", "qwen3-30b-a3b", "2", "8", env={"MODE": "default"})
    assert done.returncode == 0, done.stderr
    assert calls[0].endswith("runs/qwen3-30b-a3b_8l_8k_default --num-hidden-layers 8")
    assert "--batch-invariant-mode" not in calls[-1] and "runs/qwen3-30b-a3b_8l_8k_default/metrics.jsonl" in calls[-1]
    done, calls = run_stubbed(tmp_path / "bi", "rl_at_size.sh", "qwen3-30b-a3b", "2", "8")
    assert "--batch-invariant-mode" in calls[-1] and "runs/qwen3-30b-a3b_8l_8k/metrics.jsonl" in calls[-1]


def test_a_bad_mode_stops_before_any_work(tmp_path):
    done, calls = run_stubbed(tmp_path, "rl_at_size.sh", "qwen3-4b", "2", env={"MODE": "fast"})
    assert done.returncode == 2 and "MODE must be bi or default, got 'fast'" in done.stderr and calls == []
