"""examples/rl_at_size.sh reads STEPS, then LAYERS only when it is a number, so flags may follow
STEPS (e.g. --rl-generator-ranks 1); run in a copy with `python` and `torchrun` stubbed."""

import os
import shutil
import subprocess

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STUB = """#!/usr/bin/env bash
echo "$(basename "$0") $*" >> "$STUB_LOG"
if [ "$1" = tools/random_hf_checkpoint.py ]; then mkdir -p "$3"; fi
"""


def _run(tmp_path, *args):
    shutil.copytree(os.path.join(REPO, "examples"), tmp_path / "examples")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("python", "torchrun"):
        (bin_dir / name).write_text(STUB)
        (bin_dir / name).chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "STUB_LOG": str(tmp_path / "calls")}
    done = subprocess.run(["bash", str(tmp_path / "examples" / "rl_at_size.sh"), *args], env=env,
                          capture_output=True, text=True)
    calls = (tmp_path / "calls").read_text().splitlines() if (tmp_path / "calls").exists() else []
    return done, calls


def test_flags_right_after_steps_reach_the_run_not_the_checkpoint(tmp_path):
    done, calls = _run(tmp_path, "qwen3-4b", "3", "--rl-generator-ranks", "1")
    assert done.returncode == 0, done.stderr
    assert calls[0] == "python tools/random_hf_checkpoint.py qwen3-4b runs/qwen3-4b_8k"
    assert calls[-1].startswith("torchrun --nproc-per-node 1 pretrain_rl.py")
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
