"""The RL loop: rollouts from the engine -> policy update -> the same weights serve the engine.

Synchronous and on-policy: every step generates with the weights the previous step produced
(`weight_version` counts optimizer steps) and trains on those rollouts only. Each data-parallel
rank generates its own prompts on its own GPU with its own engine; gradients are summed across
ranks by Megatron's DDP. Every step's sampling seed is a function of (seed, step, rank), so a run
resumed from a checkpoint repeats the uninterrupted one.
"""

import time
import dataclasses
from dataclasses import dataclass

import torch

from megatron_rl_bi.envs import PromptSource
from megatron_rl_bi.inference import Generator, Sampling
from megatron_rl_bi.reporting.metrics import MetricsLogger
from megatron_rl_bi.rl.checkpoint import load_checkpoint, save_checkpoint
from megatron_rl_bi.rl.rollouts import RolloutConfig, collect_rollouts
from megatron_rl_bi.rl.sft import sft_step
from megatron_rl_bi.rl.step import StepConfig, train_on_rollouts

_SUMMED_STATS = ("rollouts/groups", "rollouts/groups_dropped", "rollouts/generated",
                 "rollouts/verifier_failures")
# SFT examples come from a far-away stretch of the task's index space, disjoint from RL prompts.
_SFT_INDEX_OFFSET = 1 << 40


@dataclass(kw_only=True)
class LoopConfig:
    steps: int
    seed: int
    save_dir: str | None = None
    save_interval: int = 0
    load_dir: str | None = None
    load_optimizer: bool = True
    sft_warmup_steps: int = 0
    sft_batch_size: int = 64
    sft_lr: float | None = None


def _reduce_stats(stats: dict) -> dict:
    world = torch.distributed.get_world_size()
    names = list(stats)
    values = torch.tensor([stats[n] for n in names], dtype=torch.float64,
                          device=torch.cuda.current_device())
    torch.distributed.all_reduce(values)
    return {n: v if n in _SUMMED_STATS else v / world for n, v in zip(names, values.tolist())}


def _sft_warmup(ddp, optimizer, task, tokenizer, config: LoopConfig, logger) -> None:
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    source = PromptSource(task, config.seed, rank, world)
    source.position = _SFT_INDEX_OFFSET
    saved_lrs = [group["lr"] for group in optimizer.param_groups]
    if config.sft_lr is not None:
        for group in optimizer.param_groups:
            group["lr"] = config.sft_lr
    for step in range(1, config.sft_warmup_steps + 1):
        loss = sft_step(ddp, optimizer, source.take(config.sft_batch_size), tokenizer)
        if logger and (step % 25 == 0 or step == config.sft_warmup_steps):
            print(f"sft warm-up {step}/{config.sft_warmup_steps} | nll {loss:.4f}", flush=True)
    for group, lr in zip(optimizer.param_groups, saved_lrs):
        group["lr"] = lr


def run_rl(
    *,
    ddp,
    optimizer,
    generator: Generator,
    task,
    tokenizer,
    rollout_config: RolloutConfig,
    step_config: StepConfig,
    sampling: Sampling,
    config: LoopConfig,
    logger: MetricsLogger | None,
    ref_model=None,
) -> None:
    """`logger` is None on ranks that do not log."""
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    source = PromptSource(task, config.seed, rank, world)
    start_step, weight_version = 0, 0
    state = load_checkpoint(config.load_dir, ddp, optimizer, config.load_optimizer) if config.load_dir else None
    if state is not None:
        start_step, weight_version = state["step"], state["weight_version"]
        source.load_state_dict(state["source"])
        if logger:
            print(f"resumed from {config.load_dir} at step {start_step}", flush=True)
    elif config.sft_warmup_steps:
        _sft_warmup(ddp, optimizer, task, tokenizer, config, logger)
    started = time.time()
    for step in range(start_step + 1, config.steps + 1):
        step_start = time.time()
        step_sampling = dataclasses.replace(sampling, seed=sampling.seed + 1_000_003 * step + rank)
        groups, stats = collect_rollouts(generator, source, tokenizer, step_sampling,
                                         rollout_config, weight_version)
        generation_s = time.time() - step_start
        rollouts = [r for group in groups for r in group]
        metrics = train_on_rollouts(ddp, optimizer, rollouts, step_config, ref_model)
        weight_version += step_config.updates_per_step
        torch.cuda.synchronize()
        step_s = time.time() - step_start
        tokens = torch.tensor([float(sum(len(r.tokens) for r in rollouts))],
                              device=torch.cuda.current_device())
        torch.distributed.all_reduce(tokens)
        done = step - start_step
        metrics.update(_reduce_stats(stats))
        metrics.update({
            "weight_version": weight_version,
            "time/step_s": step_s,
            "time/generation_s": generation_s,
            "throughput/tokens_per_s": tokens.item() / step_s,
            "time/eta_s": (time.time() - started) / done * (config.steps - step),
        })
        if logger:
            logger.log(step, metrics)
        last = step == config.steps
        if config.save_dir and ((config.save_interval and step % config.save_interval == 0) or last):
            save_checkpoint(config.save_dir, step, ddp, optimizer, {
                "step": step, "weight_version": weight_version, "source": source.state_dict(),
            })
