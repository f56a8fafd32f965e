"""Parsed flags -> each component's own config dataclass; the only place that reads `args` for
them (the entry points pass the results on)."""

import argparse

from megatron_rl_bi.inference import EngineConfig, Sampling
from megatron_rl_bi.rl.loop import LoopConfig
from megatron_rl_bi.rl.losses import LossConfig
from megatron_rl_bi.rl.rollouts import RolloutConfig
from megatron_rl_bi.rl.step import StepConfig


def engine_config_from_args(args: argparse.Namespace, prompt_logprobs: bool = False,
                            temperature: float = 1.0) -> EngineConfig:
    """The engine's sizes from Megatron's own --inference-* flags; logprobs of the distribution
    at the `temperature` it will sample with."""
    defaults = EngineConfig()
    return EngineConfig(
        max_requests=args.inference_dynamic_batching_max_requests or defaults.max_requests,
        max_tokens=args.inference_dynamic_batching_max_tokens or defaults.max_tokens,
        max_sequence_length=args.inference_max_seq_length,
        buffer_size_gb=args.inference_dynamic_batching_buffer_size_gb,
        block_size_tokens=args.inference_dynamic_batching_block_size,
        prompt_logprobs=prompt_logprobs,
        processed_logprobs=temperature != 1.0,
        cuda_graphs=(args.inference_dynamic_batching_num_cuda_graphs
                     if args.cuda_graph_impl == "local" else None),
        cuda_graphs_decode_only=args.decode_only_cuda_graphs,
        async_scheduling=args.inference_dynamic_batching_async_sched_mode == "async",
    )


def rollout_config_from_args(args: argparse.Namespace) -> RolloutConfig:
    return RolloutConfig(
        prompts_per_step=args.grpo_prompts_per_step,
        group_size=args.grpo_group_size,
        dynamic_sampling=args.grpo_filter_groups_with_same_reward,
        max_rounds=args.rl_dynamic_sampling_max_rounds,
        overlong_buffer=args.rl_overlong_buffer,
        overlong_penalty=args.rl_overlong_penalty,
        normalize_std=not args.rl_no_advantage_std,
    )


def loss_config_from_args(args: argparse.Namespace) -> LossConfig:
    return LossConfig(
        eps_low=args.grpo_clamp_eps_lower,
        eps_high=args.grpo_clamp_eps_upper,
        kl_beta=args.grpo_kl_beta,
        entropy_weight=args.grpo_entropy_term_weight,
        tis_cap=(args.rl_importance_sampling_truncation_coef
                 if args.rl_inference_logprobs_is_correction else None),
    )


def step_config_from_args(args: argparse.Namespace) -> StepConfig:
    return StepConfig(
        loss=loss_config_from_args(args),
        aggregation=args.rl_loss_aggregation,
        micro_batch_tokens=args.rl_micro_batch_tokens,
        updates_per_step=args.grpo_iterations,
        temperature=args.rl_default_temperature,
    )


def sampling_from_args(args: argparse.Namespace, eod_id: int | None) -> Sampling:
    return Sampling(
        max_new_tokens=args.rl_max_new_tokens,
        temperature=args.rl_default_temperature,
        top_k=args.rl_default_top_k,
        top_p=args.rl_default_top_p,
        eod_id=eod_id,
        seed=args.seed,
    )


def loop_config_from_args(args: argparse.Namespace) -> LoopConfig:
    return LoopConfig(
        steps=args.train_iters,
        seed=args.seed,
        save_dir=args.save,
        save_interval=args.save_interval or 0,
        keep_last=args.rl_keep_last_k,
        load_dir=args.load,
        load_optimizer=not args.no_load_optim,
        sft_warmup_steps=args.rl_sft_warmup_steps,
        sft_batch_size=args.rl_sft_batch_size,
        sft_lr=args.rl_sft_lr,
        save_hf_dir=args.save_hf,
        save_hf_interval=args.save_hf_interval,
        eval_interval=args.eval_interval or 0,
        exit_interval=args.exit_interval or 0,
        exit_duration_s=(args.exit_duration_in_mins or 0) * 60,
        exit_signal=args.exit_signal if args.exit_signal_handler else None,
    )
