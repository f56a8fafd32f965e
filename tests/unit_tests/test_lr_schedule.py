"""The learning-rate schedule from Megatron's flags, counted in optimizer updates (CPU, a
stand-in optimizer: megatron-core's scheduler only reads and writes `param_groups`)."""

import math
from types import SimpleNamespace

import pytest
import torch

from megatron_rl_bi.config import parse_rl_args
from megatron_rl_bi.optimizer import build_lr_scheduler

MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
         "--seq-length", "64", "--max-position-embeddings", "64"]


def _optimizer():
    return SimpleNamespace(param_groups=[{"lr": 0.0, "wd_mult": 1.0}, {"lr": 0.0, "wd_mult": 0.0}])


def _lrs(scheduler, optimizer, updates):
    seen = []
    for _ in range(updates):
        seen.append(optimizer.param_groups[0]["lr"])
        scheduler.step(increment=1)
    return seen


def test_default_is_constant():
    optimizer = _optimizer()
    scheduler = build_lr_scheduler(parse_rl_args(MODEL + ["--lr", "3e-4", "--train-iters", "5"]),
                                   optimizer)
    assert _lrs(scheduler, optimizer, 6) == [3e-4] * 6


def test_warmup_then_cosine_counts_updates_per_rl_step():
    # 4 RL steps x 2 updates = 8 updates: warmup over 1 RL step (2 updates), cosine to min_lr
    args = parse_rl_args(MODEL + ["--lr", "1.0", "--min-lr", "0.1", "--lr-decay-style", "cosine",
                                  "--lr-warmup-iters", "1", "--train-iters", "4",
                                  "--grpo-iterations", "2", "--weight-decay", "0.5"])
    optimizer = _optimizer()
    scheduler = build_lr_scheduler(args, optimizer)
    lrs = _lrs(scheduler, optimizer, 9)
    cosine = [0.1 + 0.45 * (math.cos(math.pi * k / 6) + 1) for k in range(7)]
    assert lrs == pytest.approx([0.0, 0.5] + cosine)
    assert optimizer.param_groups[0]["weight_decay"] == 0.5
    assert optimizer.param_groups[1]["weight_decay"] == 0.0  # wd_mult 0 (norms, biases)


def test_state_survives_a_checkpoint_without_pickle(tmp_path):
    args = parse_rl_args(MODEL + ["--lr", "1.0", "--lr-decay-style", "linear", "--train-iters", "10"])
    optimizer = _optimizer()
    scheduler = build_lr_scheduler(args, optimizer)
    _lrs(scheduler, optimizer, 4)
    torch.save(scheduler.state_dict(), tmp_path / "s.pt")
    resumed_optimizer = _optimizer()
    resumed = build_lr_scheduler(args, resumed_optimizer)
    resumed.load_state_dict(torch.load(tmp_path / "s.pt", weights_only=True))
    assert resumed_optimizer.param_groups[0]["lr"] == optimizer.param_groups[0]["lr"] == pytest.approx(0.6)
