"""Parsed flags -> each component's own config dataclass; the only place that reads `args` for
them (the entry points pass the results on)."""

import argparse

import torch
from megatron.core.optimizer import USING_PYTORCH_OPTIMIZER
from megatron.training.vocab_utils import calculate_padded_vocab_size

from megatron_rl_bi.checkpoints.hf import HFModel, load_hf_weights
from megatron_rl_bi.checkpoints.megatron import load_pretrained_weights
from megatron_rl_bi.envs.environment import build_environment
from megatron_rl_bi.envs.retrieval import RemoteRetriever
from megatron_rl_bi.envs.sandbox import SandboxConfig, base_interpreter
from megatron_rl_bi.inference import EngineConfig, Sampling
from megatron_rl_bi.memory import GIB, OUTSIDE_TORCH_BYTES, EngineShape, Levers, ModelShape, Recompute, RunShape
from megatron_rl_bi.models.build import build_model
from megatron_rl_bi.models.gpt_spec import moe_layers
from megatron_rl_bi.reporting.profiling import MemoryHistoryConfig, ProfileConfig
from megatron_rl_bi.rl.loop import LoopConfig
from megatron_rl_bi.rl.conversations import TurnConfig
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
        kv_cache_management_mode=args.rl_kv_cache_management_mode,
        prefix_caching=args.inference_dynamic_batching_enable_prefix_caching,
    )


def rollout_config_from_args(args: argparse.Namespace, task=None) -> RolloutConfig:
    """The rollouts' config; --rl-env's class is built here (a ValueError naming the flag), over
    `task`'s own corpus for the built-in search without --rl-search-corpus."""
    return RolloutConfig(
        prompts_per_step=args.grpo_prompts_per_step,
        group_size=args.grpo_group_size,
        dynamic_sampling=args.grpo_filter_groups_with_same_reward,
        max_rounds=args.rl_dynamic_sampling_max_rounds,
        overlong_buffer=args.rl_overlong_buffer,
        overlong_penalty=args.rl_overlong_penalty,
        normalize_std=not args.rl_no_advantage_std,
        environment=(build_environment(args.rl_env, task, args.rl_search_corpus, args.rl_search_top_k,
                                       code_sandbox_from_args(args), search_server_from_args(args))
                     if args.rl_env else None),
        turns=TurnConfig(max_turns=args.rl_max_turns, max_context_tokens=args.rl_max_context_tokens,
                         observation_tokens=args.rl_tool_output_tokens, env_timeout_s=args.rl_env_timeout,
                         env_workers=args.rl_env_workers, tool_format=args.rl_tool_format,
                         record=args.rl_env_record, replay=args.rl_env_replay),
    )


def search_server_from_args(args: argparse.Namespace) -> RemoteRetriever | None:
    """--rl-search-url's client, or None."""
    if not args.rl_search_url:
        return None
    return RemoteRetriever(args.rl_search_url, timeout_s=args.rl_search_timeout, retries=args.rl_search_retries)


def code_sandbox_from_args(args: argparse.Namespace) -> SandboxConfig:
    """Where --rl-env code runs its programs."""
    return SandboxConfig(python=args.rl_code_python or base_interpreter(), isolated=not args.rl_code_without_isolation,
                         seconds=args.rl_code_time_limit, memory_mb=args.rl_code_memory_mb)


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
        generation_lag=args.rl_generation_lag,
        keep_old_weights=args.rl_keep_old_weights,
        exit_interval=args.exit_interval or 0,
        exit_duration_s=(args.exit_duration_in_mins or 0) * 60,
        exit_signal=args.exit_signal if args.exit_signal_handler else None,
        offload_optimizer_during_inference=args.rl_offload_optimizer_during_inference,
        profile=_profile_from_args(args),
        memory_history=memory_history_from_args(args),
    )


def _profile_from_args(args: argparse.Namespace) -> ProfileConfig | None:
    if not args.profile:
        return None
    return ProfileConfig(start=args.profile_step_start, end=args.profile_step_end, ranks=tuple(args.profile_ranks),
                         output_dir=args.tensorboard_dir if args.use_pytorch_profiler else None,
                         shapes=args.pytorch_profiler_collect_shapes, stack=args.pytorch_profiler_collect_callstack)


def memory_history_from_args(args: argparse.Namespace) -> MemoryHistoryConfig | None:
    if not args.record_memory_history:
        return None
    return MemoryHistoryConfig(path=args.memory_snapshot_path, ranks=tuple(args.profile_ranks))


def model_shape_from_args(args: argparse.Namespace, vocab_size: int) -> ModelShape:
    """The model's shape for the memory plan; `vocab_size` before Megatron's padding."""
    param_bytes = 2 if args.bf16 or args.fp16 else 4
    if args.hybrid_layer_pattern:
        layers = tuple(args.hybrid_layer_pattern)
    else:
        layers = tuple("*E" if moe else "*-" for moe in moe_layers(args.num_layers, args.num_experts, args.moe_layer_freq))
    return ModelShape(
        layers=layers, hidden=args.hidden_size, ffn=args.ffn_hidden_size, heads=args.num_attention_heads,
        kv_heads=args.num_query_groups if args.group_query_attention else args.num_attention_heads,
        head_dim=args.kv_channels,
        vocab=calculate_padded_vocab_size(vocab_size, args.make_vocab_size_divisible_by, 1, logging_enabled=False),
        swiglu=args.swiglu, bias=args.add_bias_linear, tied=not args.untie_embeddings_and_output_weights,
        qk_norm=args.qk_layernorm, output_gate=args.attention_output_gate,
        gdn_key_heads=args.linear_num_key_heads or 0, gdn_value_heads=args.linear_num_value_heads or 0,
        gdn_key_dim=args.linear_key_head_dim or 0, gdn_value_dim=args.linear_value_head_dim or 0,
        gdn_conv_kernel=args.linear_conv_kernel_dim or 0, param_bytes=param_bytes,
        rotary_dim=(int(args.kv_channels * args.rotary_percent)
                    if args.position_embedding_type in ("rope", "mrope") else 0),
        experts=args.num_experts or 0, topk=args.moe_router_topk if args.num_experts else 0,
        expert_ffn=(args.moe_ffn_hidden_size or args.ffn_hidden_size) if args.num_experts else 0,
        shared_ffn=args.moe_shared_expert_intermediate_size or 0,
        shared_gate=bool(args.moe_shared_expert_intermediate_size and args.moe_shared_expert_gate),
        router_bytes=4 if args.moe_router_dtype == "fp32" else param_bytes,
        load_balancing_loss=bool(args.num_experts) and _load_balancing_loss(args),
        z_loss=bool(args.num_experts and args.moe_z_loss_coeff),
    )


def _load_balancing_loss(args: argparse.Namespace) -> bool:
    """megatron-core's TopKRouter.is_aux_loss_enabled: an aux_loss type with a coefficient > 0."""
    types, coeffs = args.moe_router_load_balancing_type, args.moe_aux_loss_coeff
    types = types if isinstance(types, list) else [types]
    coeffs = coeffs if isinstance(coeffs, list) else [coeffs]
    if len(coeffs) == 1:  # one coefficient for every type
        coeffs = coeffs * len(types)
    return any(t in ("aux_loss", "seq_aux_loss", "global_aux_loss") and c > 0 for t, c in zip(types, coeffs))


def engine_shape(config: EngineConfig) -> EngineShape:
    return EngineShape(max_requests=config.max_requests, max_sequence_length=config.max_sequence_length,
                       block_tokens=config.block_size_tokens, buffer_bytes=int(config.buffer_size_gb * GIB),
                       cuda_graphs=config.cuda_graphs is not None)


def levers_from_args(args: argparse.Namespace) -> Levers:
    return Levers(
        recompute=Recompute(args.recompute_granularity, args.recompute_method, args.recompute_num_layers or 1),
        distributed_optimizer=args.use_distributed_optimizer, optimizer_cpu_offload=args.optimizer_cpu_offload,
        offload_optimizer_during_inference=args.rl_offload_optimizer_during_inference,
        kv_cache_mode=args.rl_kv_cache_management_mode, kv_cache_fraction=args.rl_kv_cache_memory_fraction,
        reference_model=args.grpo_kl_beta > 0,
    )


def memory_run_from_args(args: argparse.Namespace, vocab_size: int, data_parallel: int,
                         gpu_bytes: int, generator: bool = False) -> RunShape:
    """The run's shape for the memory plan of one process: a generator's with `generator`, else a
    trainer's (colocated unless --rl-generator-ranks puts the engine elsewhere)."""
    role = "generator" if generator else "trainer" if args.rl_generator_ranks else "colocated"
    return RunShape(model=model_shape_from_args(args, vocab_size), engine=engine_shape(engine_config_from_args(args)),
                    micro_batch_tokens=args.rl_micro_batch_tokens, data_parallel=data_parallel,
                    gpu_bytes=gpu_bytes, requests=args.grpo_prompts_per_step * args.grpo_group_size, role=role,
                    fused_adam=not USING_PYTORCH_OPTIMIZER, outside_torch_bytes=OUTSIDE_TORCH_BYTES)


def model_vocab_size(args: argparse.Namespace, tokenizer) -> int:
    vocab_size = args.vocab_size or tokenizer.vocab_size
    if tokenizer.vocab_size > vocab_size:
        raise ValueError(f"--rl-tokenizer {args.rl_tokenizer} has {tokenizer.vocab_size} tokens, "
                         f"more than the model's vocabulary ({vocab_size})")
    return vocab_size


def build_policy(args: argparse.Namespace, vocab_size: int, hf_model: HFModel | None) -> torch.nn.Module:
    """The model, with the starting weights of --hf-checkpoint or --pretrained-checkpoint."""
    model = build_model(args, vocab_size)
    if hf_model is not None:
        load_hf_weights(model, hf_model)
    if args.pretrained_checkpoint:
        load_pretrained_weights(args.pretrained_checkpoint, model)
    return model
