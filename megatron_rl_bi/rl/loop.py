"""The RL loop: rollouts from the engine -> policy update -> the same weights serve the engine.

Synchronous and on-policy: every step generates with the weights the previous step produced
(`weight_version` counts optimizer steps) and trains on those rollouts only. Each data-parallel
rank generates its own prompts on its own GPU with its own engine; gradients are summed across
ranks by Megatron's DDP. Every step's sampling seed is a function of (seed, step, rank), so a run
resumed from a checkpoint repeats the uninterrupted one.
"""

import os
import signal
import time
from dataclasses import dataclass

import torch
from megatron.training.dist_signal_handler import DistributedSignalHandler

from megatron_rl_bi.bridge import Bridge
from megatron_rl_bi.checkpoints.hf import HFModel, export_hf
from megatron_rl_bi.checkpoints.megatron import (
    iteration_dir_name,
    load_checkpoint,
    save_checkpoint,
)
from megatron_rl_bi.distributed import MetricTerms, all_reduce_metrics
from megatron_rl_bi.envs import PromptSource
from megatron_rl_bi.envs.tool_format import build_tool_format
from megatron_rl_bi.inference import Generator, Sampling
from megatron_rl_bi.reporting.gpu_memory import PeakMemory
from megatron_rl_bi.reporting.metrics import MetricsLogger
from megatron_rl_bi.reporting.profiling import MemoryHistoryConfig, MemorySnapshots, ProfileConfig, StepProfiler
from megatron_rl_bi.rl.evaluate import validation_terms
from megatron_rl_bi.rl.generation_ahead import GenerationAhead, staleness_terms
from megatron_rl_bi.rl.generator_apart import RemoteGeneration, Schedule
from megatron_rl_bi.rl.old_weights import KeptWeights
from megatron_rl_bi.rl.optimizer_offload import generating
from megatron_rl_bi.rl.rollouts import RolloutConfig, collect_rollouts, step_sampling
from megatron_rl_bi.rl.sft import sft_step
from megatron_rl_bi.rl.step import StepConfig, train_on_rollouts

# SFT examples come from a far-away stretch of the task's index space, disjoint from RL prompts.
_SFT_INDEX_OFFSET = 1 << 40


@dataclass(kw_only=True)
class LoopConfig:
    steps: int
    """RL steps (--train-iters)."""
    seed: int
    """Seeds the prompts, their order and every step's sampling (--seed); saved with each
    checkpoint, and a resumed run must continue with the checkpoint's."""
    save_dir: str | None = None
    """Checkpoint root (--save)."""
    save_interval: int = 0
    """Save every N steps, and at the end (--save-interval)."""
    keep_last: int = 0
    """Checkpoints kept under save_dir, newest first; 0: all (--rl-keep-last-k)."""
    load_dir: str | None = None
    """Resume from the latest checkpoint under this root (--load)."""
    load_optimizer: bool = True
    """Restore the optimizer state on resume (off with --no-load-optim)."""
    sft_warmup_steps: int = 0
    """Supervised steps before RL, skipped on resume (--rl-sft-warmup-steps)."""
    sft_batch_size: int = 64
    """Examples per warm-up step (--rl-sft-batch-size)."""
    sft_lr: float | None = None
    """Learning rate of the warm-up; None keeps --lr (--rl-sft-lr)."""
    save_hf_dir: str | None = None
    """Root of the Hugging Face exports, DIR/iter_N (--save-hf)."""
    save_hf_interval: int = 0
    """Export every N steps, and at the end (--save-hf-interval)."""
    eval_interval: int = 0
    """Validation reward every N steps; 0: never (--eval-interval)."""
    exit_interval: int = 0
    """Stop after a step divisible by N, with a checkpoint under save_dir (--exit-interval):
    the rest of the run, schedule included, continues with --load."""
    exit_duration_s: float = 0.0
    """Stop the same way after the first step that ends this long after the loop started
    (warm-up included; --exit-duration-in-mins, e.g. a job's time limit less a margin)."""
    exit_signal: signal.Signals | None = None
    """Stop the same way after the step during which any rank received this signal
    (--exit-signal-handler, --exit-signal; e.g. SIGTERM ahead of a preemption); None: the
    signal keeps its default action."""
    generation_lag: int = 0
    """Steps a batch may be generated ahead of the step that trains on it
    (--rl-generation-lag, with --rl-partial-rollouts); 0: the synchronous loop."""
    keep_old_weights: int = 0
    """Weight versions kept on the CPU to recompute stale rollouts under the weights that sampled
    them (--rl-keep-old-weights)."""
    offload_optimizer_during_inference: bool = False
    """The optimizer's GPU state (fp32 main weights, Adam moments) waits in page-locked host memory
    while the engine generates (--rl-offload-optimizer-during-inference; rl/optimizer_offload.py)."""
    profile: ProfileConfig | None = None
    """Steps to trace (--profile and its flags: reporting/profiling.py); None: none."""
    memory_history: MemoryHistoryConfig | None = None
    """Where recording ranks write the allocator's history after each step (--record-memory-history);
    None: nowhere."""


def _sft_warmup(ddp, optimizer, task, tokenizer, rollout_config: RolloutConfig | None, config: LoopConfig,
                logger) -> None:
    """Demonstrations in the run's tool format (envs.tool_format), as its conversations hold them
    (`rollout_config` None or without an environment: the demonstrations' own text)."""
    environment = rollout_config.environment if rollout_config else None
    turns = build_tool_format(rollout_config.turns.tool_format, tokenizer, environment) if environment else None
    observation_tokens = rollout_config.turns.observation_tokens if rollout_config else 0
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    source = PromptSource(task, config.seed, rank, world)
    source.position = _SFT_INDEX_OFFSET
    saved_lrs = [group["lr"] for group in optimizer.param_groups]
    if config.sft_lr is not None:
        for group in optimizer.param_groups:
            group["lr"] = config.sft_lr
    started = time.perf_counter()
    for step in range(1, config.sft_warmup_steps + 1):
        loss = sft_step(ddp, optimizer, source.take(config.sft_batch_size), tokenizer, turns,
                        observation_tokens)
        if logger and (step % 25 == 0 or step == config.sft_warmup_steps):
            print(f"sft warm-up {step}/{config.sft_warmup_steps} | nll {loss:.4f}", flush=True)
    if logger:  # the loss's .item() waited for the GPU
        logger.add_to_next_record({"time/startup_sft_s": time.perf_counter() - started})
    for group, lr in zip(optimizer.param_groups, saved_lrs):
        group["lr"] = lr


def _resume_or_warm_up(ddp, optimizer, lr_scheduler, source, ahead, task, tokenizer, config, logger,
                       rollout_config: RolloutConfig | None = None) -> tuple[int, int]:
    """(step, weight version) to continue from: a checkpoint's under --load (with the prompt
    position, the batches generated ahead and the learning-rate schedule it saved), else (0, 0)
    after the SFT warm-up."""
    state = load_checkpoint(config.load_dir, ddp, optimizer, config.load_optimizer) if config.load_dir else None
    if state is None:
        if config.load_dir and logger:
            print(f"--load {config.load_dir}: no checkpoint there yet; starting a fresh run", flush=True)
        if config.sft_warmup_steps:
            _sft_warmup(ddp, optimizer, task, tokenizer, rollout_config, config, logger)
        return 0, 0
    if state.get("seed", config.seed) != config.seed:
        raise ValueError(f"--load {config.load_dir}: the checkpoint's run had --seed {state['seed']}, "
                         f"this one {config.seed}; its prompts and samples continue only with its seed")
    source.load_state_dict(state["source"])
    ahead.load_state_dict(state.get("ahead", []))
    if lr_scheduler is not None and "lr_scheduler" in state:
        _restore_lr_schedule(lr_scheduler, state["lr_scheduler"], config.load_dir)
    if logger:
        print(f"resumed from {config.load_dir} at step {state['step']}", flush=True)
    return state["step"], state["weight_version"]


def _restore_lr_schedule(lr_scheduler, state: dict, load_dir: str) -> None:
    """megatron-core asserts that the checkpoint's schedule equals the one the flags build."""
    try:
        lr_scheduler.load_state_dict(state)
    except AssertionError as error:
        raise ValueError(
            f"--load {load_dir}: the checkpoint's learning-rate schedule differs from this run's "
            f"({error}). Keep --train-iters and the --lr* flags of the saved run (stop early with "
            "--exit-interval), or pass --override-opt_param-scheduler to take this run's flags or "
            "--use-checkpoint-opt_param-scheduler to keep the checkpoint's schedule"
        ) from error


def _rl_step(ddp, optimizer, ahead: GenerationAhead, step: int, step_config, weight_version, ref_model,
             lr_scheduler, kept: KeptWeights, peak_memory: PeakMemory) -> tuple[dict, list]:
    """Take the step's rollouts (generating what is due), update; the step's global metrics with
    its timings (generation: what this step spent generating; training: the update, the
    trainer's forward and backward included) and each phase's peak memory, and the rollouts."""
    step_start = time.time()
    peaks = {}
    with peak_memory.phase("generation", peaks):
        groups, stats, generation_s = ahead.take(step, weight_version)
    rollouts = [r for group in groups for r in group]
    if ahead.lag:
        stats.update(staleness_terms(rollouts, weight_version))
    training_start = time.time()
    with peak_memory.phase("training", peaks):
        metrics = train_on_rollouts(ddp, optimizer, rollouts, step_config, ref_model, lr_scheduler, weight_version,
                                    kept)
        torch.cuda.synchronize()
    step_end = time.time()
    step_s, training_s = step_end - step_start, step_end - training_start
    stats.sums["tokens"] = sum(len(r.tokens) for r in rollouts)
    stats.maxima.update(peaks)
    metrics.update(all_reduce_metrics(stats))
    tokens = metrics.pop("tokens")
    metrics.update({"time/step_s": step_s, "time/generation_s": generation_s, "time/training_s": training_s,
                    "throughput/tokens_per_s": tokens / step_s})
    return metrics, rollouts


def _due(step: int, interval: int, last: bool) -> bool:
    return last or bool(interval and step % interval == 0)


class _EarlyStop:
    """Megatron's early stops (--exit-interval, --exit-duration-in-mins, --exit-signal-handler):
    each ends the run after a step short of --train-iters, with a checkpoint; every rank agrees.
    The signal handler (megatron's own) is installed for the duration of the `with` block."""

    def __init__(self, config: LoopConfig):
        self.config, self.started = config, time.time()
        self.signals = DistributedSignalHandler(config.exit_signal) if config.exit_signal else None

    def __enter__(self) -> "_EarlyStop":
        if self.signals:
            self.signals.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self.signals:
            self.signals.release()

    def reason(self, step: int) -> str | None:
        """The flag that stops the run after `step`, or None."""
        config = self.config
        if step >= config.steps:
            return None
        if _due(step, config.exit_interval, last=False):
            return f"--exit-interval {config.exit_interval}"
        if config.exit_duration_s:
            late = torch.tensor([time.time() - self.started > config.exit_duration_s],
                                dtype=torch.int32, device=torch.cuda.current_device())
            torch.distributed.all_reduce(late, op=torch.distributed.ReduceOp.MAX)
            if late.item():
                return f"--exit-duration-in-mins {config.exit_duration_s / 60:g}"
        if self.signals and any(self.signals.signals_received()):
            return f"--exit-signal-handler ({self.signals.sig.name})"
        return None


def _save(step: int, weight_version: int, ddp, optimizer, lr_scheduler, source, ahead,
          config: LoopConfig, hf_model: HFModel | None, exiting: bool) -> None:
    """The Megatron checkpoint (--save) and the Hugging Face export (--save-hf) due at `step`;
    `exiting` (an early stop) forces the checkpoint, not the export. The checkpoint holds the
    batches generated ahead with the prompt position after them."""
    last = step == config.steps
    if config.save_dir and _due(step, config.save_interval, last or exiting):
        batches = ahead.state_dict()  # first: receiving a generator's batch moves the prompt position
        rl_state = {"step": step, "weight_version": weight_version, "seed": config.seed,
                    "source": source.state_dict(), "ahead": batches}
        if lr_scheduler is not None:
            rl_state["lr_scheduler"] = lr_scheduler.state_dict()
        save_checkpoint(config.save_dir, step, ddp, optimizer, rl_state, keep_last=config.keep_last)
    if config.save_hf_dir and _due(step, config.save_hf_interval, last):
        if torch.distributed.get_rank() == 0:  # every rank holds the same weights
            export_hf(ddp, hf_model, os.path.join(config.save_hf_dir, iteration_dir_name(step)))
        torch.distributed.barrier()


def _rollout_batches(generator, bridge, optimizer, task, tokenizer, sampling, rollout_config, config, validating):
    """This rank's prompt source and where its batches come from: its own engine, or with a
    bridge the generator ranks (whose prompt position the source then only records, and which
    validate the weights when `validating`)."""
    if bridge is not None:
        interval = config.eval_interval if validating else 0
        ahead = RemoteGeneration(bridge, Schedule(config.generation_lag, config.steps, interval))
        return ahead.source, ahead
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    source = PromptSource(task, config.seed, rank, world)

    def generate(step: int, version: int) -> tuple[list, MetricTerms]:
        with generating(optimizer, config.offload_optimizer_during_inference):
            return collect_rollouts(generator, source, tokenizer, step_sampling(sampling, step, rank),
                                    rollout_config, version)

    return source, GenerationAhead(config.generation_lag, config.steps, generate)


def run_rl(
    *,
    ddp,
    optimizer,
    generator: Generator | None,
    task,
    tokenizer,
    rollout_config: RolloutConfig,
    step_config: StepConfig,
    sampling: Sampling,
    config: LoopConfig,
    logger: MetricsLogger | None,
    ref_model=None,
    lr_scheduler=None,
    hf_model: HFModel | None = None,
    eval_examples: list | None = None,
    bridge: Bridge | None = None,
) -> None:
    """`logger` is None on ranks that do not log; `lr_scheduler` steps per optimizer update and
    is checkpointed; `hf_model` is the checkpoint to export like (--save-hf); `eval_examples` the
    held-out prompts (--rl-eval-dataset); `bridge` the generator ranks' (--rl-generator-ranks),
    which then generate instead of `generator`."""
    source, ahead = _rollout_batches(generator, bridge, optimizer, task, tokenizer, sampling, rollout_config, config,
                                     validating=bool(eval_examples))
    with _EarlyStop(config) as early_stop:
        start_step, weight_version = _resume_or_warm_up(ddp, optimizer, lr_scheduler, source, ahead, task,
                                                        tokenizer, config, logger, rollout_config)
        ahead.start(start_step, weight_version, ddp)
        kept = KeptWeights(config.keep_old_weights)
        kept.keep(weight_version, ddp)
        started, peak_memory = time.time(), PeakMemory()
        profiler = StepProfiler(config.profile, torch.distributed.get_rank(), MemorySnapshots(config.memory_history))
        for step in range(start_step + 1, config.steps + 1):
            with profiler.step(step):
                metrics, rollouts = _rl_step(ddp, optimizer, ahead, step, step_config, weight_version, ref_model,
                                             lr_scheduler, kept, peak_memory)
            weight_version += metrics["optimizer_steps"]
            ahead.published(step, weight_version, ddp)
            kept.keep(weight_version, ddp)
            if eval_examples and _due(step, config.eval_interval, last=False):
                if bridge is not None:  # the generators validated the weights they were sent
                    terms = ahead.validation(step)
                else:
                    with generating(optimizer, config.offload_optimizer_during_inference):
                        terms = validation_terms(generator, eval_examples, tokenizer, sampling, config.seed,
                                                 rollout_config)
                metrics.update(all_reduce_metrics(terms))
            metrics["weight_version"] = weight_version
            metrics["time/eta_s"] = (time.time() - started) / (step - start_step) * (config.steps - step)
            if logger:
                logger.log(step, metrics, rollouts)
            reason = early_stop.reason(step)
            _save(step, weight_version, ddp, optimizer, lr_scheduler, source, ahead, config, hf_model,
                  exiting=reason is not None)
            if reason:
                if logger:
                    print(f"{reason}: stopping after step {step}", flush=True)
                break
        profiler.finish()
        ahead.finish()
