"""Megatron argument parsing extended for megatron_rl_bi, and the checks that run before any GPU work.

Megatron's own parser already has `--batch-invariant-mode`, `--flash-attention-version`,
`--transformer-impl`, the model sizes and the optimizer; `add_defaults` only changes defaults that
would otherwise fail or break parity here, and `validate_batch_invariance` turns the asserts that
megatron-core would raise deep inside model construction into one error naming every bad flag.
"""

import argparse
import traceback

from megatron.core.transformer.enums import AttnBackend

from megatron_rl_bi import compat


def raise_if_invalid(errors: list[str]) -> None:
    """One ValueError listing every problem found, or nothing."""
    if errors:
        raise ValueError("invalid arguments:\n  " + "\n  ".join(errors))


def add_defaults(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    defaults = dict(
        # Trainer (THD, per sequence) and engine (per token) must apply the same unfused rope.
        apply_rope_fusion=False,
        # torch.compile'd fusions: left out so the eager kernels are what both sides run.
        bias_dropout_fusion=False,
        bias_swiglu_fusion=False,
        bias_gelu_fusion=False,
        masked_softmax_fusion=False,
        attention_backend=AttnBackend.flash,
        transformer_impl="transformer_engine" if compat.transformer_engine_installed() else "local",
        normalization="RMSNorm",
        position_embedding_type="rope",
        hidden_dropout=0.0,
        attention_dropout=0.0,
        # The RL loss is normalized by global token counts; DP must sum gradients.
        calculate_per_token_loss=True,
        # Megatron's 40 GB KV-cache default is sized for serving large models.
        inference_dynamic_batching_buffer_size_gb=4.0,
    )
    if not compat.apex_gradient_accumulation_fusion_installed():
        # Megatron's default needs APEX's fused weight-gradient extension, with or without TE.
        defaults.update(gradient_accumulation_fusion=False)
    if not compat.transformer_engine_installed():
        defaults.update(no_persist_layer_norm=True)  # the persistent norm kernel is TE's or APEX's
    parser.set_defaults(**defaults)
    return parser


def _bi_flash_attention_error(version: int | None) -> str | None:
    """Why `--flash-attention-version version` cannot give BI parity (None: it can): both sides
    must run one pinned generation with a fixed split schedule, 3 or 4."""
    if version is None:
        return "--batch-invariant-mode needs --flash-attention-version 3 or 4"
    if version == 2:
        return ("--flash-attention-version 2 cannot be used with --batch-invariant-mode: FA2 has no "
                "fixed num_splits schedule; use 3 or 4")
    return None


def _flash_attention_error(version: int) -> str | None:
    """Why `--flash-attention-version version` cannot run here (None: it can): training attention
    (FlashCoreAttention) runs 3 or 4, installed, the generation the engine runs too."""
    from megatron_rl_bi.attention import flash_varlen_function

    try:
        flash_varlen_function(version)
    except (ImportError, ValueError) as exc:
        return str(exc)
    return None


def pick_flash_attention_version(args: argparse.Namespace) -> str | None:
    """Default mode without --flash-attention-version runs the installed generation (4, else 3),
    and says which; BI mode keeps requiring the pin (parse_args), since both sides must run the
    one named. With neither installed: the error, naming what each lacks."""
    if args.flash_attention_version is not None or args.batch_invariant_mode:
        return None
    problems = {version: _flash_attention_error(version) for version in (4, 3)}
    installed = [version for version, problem in problems.items() if problem is None]
    if not installed:
        return ("training attention needs FlashAttention 3 or 4 (--flash-attention-version), and "
                "neither is installed:\n    " + "\n    ".join(problems.values()))
    args.flash_attention_version = installed[0]
    print(f"--flash-attention-version not given: running {installed[0]}, the installed generation", flush=True)
    return None


def validate_installed_kernels(args: argparse.Namespace) -> None:
    """The checks that need installed packages (parse_args makes none, so that a machine without
    them, a planner's or CI's, can parse a run's flags): one ValueError, before any GPU work. In
    default mode a missing --flash-attention-version is the installed generation."""
    version = args.flash_attention_version
    problem = (pick_flash_attention_version(args)
               or (_bi_flash_attention_error(version) if args.batch_invariant_mode else None)
               or _flash_attention_error(args.flash_attention_version))
    errors = [problem] if problem else []
    if not problem and args.flash_attention_version == 3:
        from megatron_rl_bi.attention import fa3_missing_head_dim

        if kernel_dim := fa3_missing_head_dim(args.kv_channels):  # Megatron's parse sets kv_channels
            errors.append(f"--flash-attention-version 3: the installed flash_attn_3 was built without head "
                          f"dim {kernel_dim} (FLASHATTENTION_DISABLE_HDIM{kernel_dim}), which this model's "
                          f"head dim {args.kv_channels} needs: rebuild it with that head dim, or use 4")
    if args.transformer_impl == "transformer_engine" and not compat.transformer_engine_installed():
        errors.append("--transformer-impl transformer_engine: TransformerEngine is not installed (use local)")
    raise_if_invalid(errors)


def installed_kernel_problem(args: argparse.Namespace) -> str | None:
    """validate_installed_kernels; under --launch-check (a pre-flight, maybe on a node without
    the GPU packages) its error is returned for the check to report instead of raised."""
    try:
        validate_installed_kernels(args)
    except ValueError as exc:
        if not args.launch_check:
            raise
        return str(exc)
    return None


def moe_errors(args: argparse.Namespace, batch_invariant: bool) -> list[str]:
    """Why a --num-experts run cannot work here (models/moe.py: megatron-core's MoE layer with
    expert parallelism 1, the allgather dispatcher, SequentialMLP experts grouped without
    autograd in BI mode, engine graphs in BI mode only), and in
    BI mode what would make a token's routing depend on its batch."""
    if not args.num_experts:
        return (["--moe-enable-routing-replay without --num-experts: there is no routing to record"]
                if args.moe_enable_routing_replay else [])
    errors = []
    if args.moe_enable_routing_replay and args.inference_dynamic_batching_async_sched_mode == "async":
        errors.append("--moe-enable-routing-replay with --inference-dynamic-batching-async-sched-mode "
                      "async: megatron-core's engine records routing with synchronous steps only")
    for flag, value in (("--expert-model-parallel-size", args.expert_model_parallel_size),
                        ("--expert-tensor-parallel-size", args.expert_tensor_parallel_size)):
        if value not in (None, 1):
            errors.append(f"{flag} {value}: MoE runs with expert parallelism 1 (use data parallelism)")
    if args.moe_token_dispatcher_type != "allgather":
        errors.append(f"--moe-token-dispatcher-type {args.moe_token_dispatcher_type}: at expert "
                      "parallelism 1 the allgather dispatcher is the one supported (the default)")
    for flag, on in (("--moe-grouped-gemm", args.moe_grouped_gemm),
                     ("--moe-permute-fusion", args.moe_permute_fusion),
                     ("--moe-router-fusion", args.moe_router_fusion),
                     ("--moe-shared-expert-overlap", args.moe_shared_expert_overlap),
                     ("--moe-latent-size", args.moe_latent_size),
                     ("--moe-pad-experts-for-cuda-graph-inference",
                      args.moe_pad_experts_for_cuda_graph_inference)):
        if on:
            errors.append(f"{flag}: not supported with --num-experts here (the experts run as "
                          "megatron-core's SequentialMLP, which BI mode's engine runs as one grouped GEMM "
                          "a linear)")
    if args.moe_shared_expert_intermediate_size and args.add_bias_linear:
        errors.append("--moe-shared-expert-intermediate-size with biases: megatron-core's shared expert "
                      "has none; pass --disable-bias-linear")
    if args.cuda_graph_impl != "none" and not batch_invariant:
        errors.append(f"--cuda-graph-impl {args.cuda_graph_impl} with --num-experts in default mode: "
                      "megatron-core's dispatcher and experts split tokens on the host, which a graph "
                      "cannot hold; leave it none, or add --batch-invariant-mode (whose experts do not)")
    if args.cuda_graph_impl != "none" and args.moe_enable_routing_replay:
        errors.append(f"--cuda-graph-impl {args.cuda_graph_impl} with --moe-enable-routing-replay: the "
                      "routers record their choices in Python, which a replayed graph skips; leave it none")
    if batch_invariant:
        if args.moe_expert_capacity_factor is not None or args.moe_pad_expert_input_to_capacity:
            errors.append("--moe-expert-capacity-factor with --batch-invariant-mode: which tokens an "
                          "expert drops depends on the rest of the batch; leave it unset")
        if "sinkhorn" in args.moe_router_load_balancing_type:
            errors.append("--moe-router-load-balancing-type sinkhorn with --batch-invariant-mode: "
                          "sinkhorn normalizes across the batch's tokens; use aux_loss, seq_aux_loss, "
                          "global_aux_loss or none")
        if args.moe_input_jitter_eps:
            errors.append("--moe-input-jitter-eps with --batch-invariant-mode: the trainer's router "
                          "would see noise the engine's does not; leave it unset")
        if args.moe_router_force_load_balancing:
            errors.append("--moe-router-force-load-balancing with --batch-invariant-mode: random "
                          "routing; leave it off")
    return errors


def validate_batch_invariance(args: argparse.Namespace, batch_invariant: bool | None = None) -> None:
    """Raises one ValueError listing every flag that breaks trainer/engine parity, in BI mode
    when `batch_invariant` (default: --batch-invariant-mode) is true."""
    errors = []
    if args.tensor_model_parallel_size != 1:
        errors.append(
            f"--tensor-model-parallel-size {args.tensor_model_parallel_size}: only TP=1 is "
            "supported (use data parallelism)"
        )
    if args.pipeline_model_parallel_size != 1:
        errors.append(f"--pipeline-model-parallel-size {args.pipeline_model_parallel_size}: only PP=1")
    if args.apply_rope_fusion:
        errors.append("rope fusion must be off (--no-rope-fusion): the engine applies rope unfused")
    if args.attention_dropout > 0:  # FlashCoreAttention, in every mode
        errors.append(f"--attention-dropout {args.attention_dropout}: training attention runs "
                      "without dropout; use 0")
    batch_invariant = args.batch_invariant_mode if batch_invariant is None else batch_invariant
    errors += moe_errors(args, batch_invariant)
    if batch_invariant:
        if problem := _bi_flash_attention_error(args.flash_attention_version):
            errors.append(problem)
        if args.context_parallel_size != 1:
            errors.append(
                f"--context-parallel-size {args.context_parallel_size} with --batch-invariant-mode: "
                "context parallelism runs TE's own attention kernels; use 1"
            )
        if args.hidden_dropout > 0:
            errors.append(f"--hidden-dropout {args.hidden_dropout} with --batch-invariant-mode: "
                          "dropout masks are not batch-invariant; use 0")
        if args.attention_backend != AttnBackend.flash:
            errors.append(
                f"--attention-backend {args.attention_backend.name} with --batch-invariant-mode: "
                "use flash"
            )
        if args.normalization != "RMSNorm":
            errors.append(
                f"--normalization {args.normalization} with --batch-invariant-mode: only RMSNorm "
                "has a batch-invariant kernel"
            )
    raise_if_invalid(errors)


def validate_cuda_graphs(args: argparse.Namespace) -> None:
    """CUDA graphs here are the dynamic engine's, over the whole decoder block (the trainer stays
    eager): one ValueError naming every flag that asks for anything else."""
    if args.cuda_graph_impl == "none":
        return
    errors = []
    if args.cuda_graph_impl != "local":
        errors.append(f"--cuda-graph-impl {args.cuda_graph_impl}: only local (the engine's graphs)")
    if args.inference_cuda_graph_scope != "block":
        errors.append(f"--inference-cuda-graph-scope {args.inference_cuda_graph_scope}: use block "
                      "(layer scope also records graphs of the trainer's forward)")
    if args.cuda_graph_modules:
        errors.append("--cuda-graph-modules: leave it unset (whole block)")
    if args.hybrid_layer_pattern and not args.decode_only_cuda_graphs:
        errors.append("--cuda-graph-impl local with --hybrid-layer-pattern needs "
                      "--decode-only-cuda-graphs (GDN layers are captured in decode-only steps)")
    if errors:
        raise ValueError("invalid CUDA graph arguments:\n  " + "\n  ".join(errors))


def validate_save_interval(args: argparse.Namespace) -> None:
    """--save needs --save-interval >= 1; Megatron's validate_args asserts it without a message."""
    if not args.save:
        return
    if args.save_interval is None:
        raise_if_invalid(["--save needs --save-interval N (steps between checkpoints)"])
    if args.save_interval < 1:
        raise_if_invalid([f"--save-interval must be >= 1 with --save, got {args.save_interval}"])


def add_launch_check_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    group = parser.add_argument_group("megatron_rl_bi: launch")
    group.add_argument("--launch-check", action="store_true",
                       help="do everything up to the first GPU work (flags, inputs, torch.distributed "
                       "over gloo, megatron-core's data-parallel groups), print each process's world "
                       "size, rank, node and data-parallel group and the step a --load would resume "
                       "from, and exit: a pre-flight of a cluster launch")
    return parser


def _provider(extra_args_provider):
    def provider(parser):
        parser = add_launch_check_args(add_defaults(parser))
        parser = extra_args_provider(parser) if extra_args_provider else parser
        compat.escape_help_percent_signs(parser)
        return parser

    return provider


def build_parser(extra_args_provider=None) -> argparse.ArgumentParser:
    """The parser `parse_args` parses with: Megatron's flags, this package's defaults, and the
    caller's flags (for --help and for checking that a flag exists)."""
    from megatron.training.arguments import add_megatron_arguments

    parser = add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))
    return _provider(extra_args_provider)(parser)


def validate_model_given(args: argparse.Namespace) -> None:
    """No layers at all: megatron-core's own message names neither the recipe nor the flag that
    would give them (a Qwen recipe takes its model from --hf-checkpoint)."""
    if args.num_layers is None and args.encoder_num_layers is None and not args.hybrid_layer_pattern:
        raise ValueError("no model: neither --num-layers nor --hybrid-layer-pattern is given; a recipe "
                         "without model flags (examples/recipes/qwen3*_math_dapo.yaml) takes them from "
                         "--hf-checkpoint DIR")


def parse_args(argv: list[str] | None = None, extra_args_provider=None) -> argparse.Namespace:
    """Megatron's parser + our defaults (+ the caller's flags), then our checks, then Megatron's.

    `argv` defaults to sys.argv[1:]; Megatron's parse_args only reads sys.argv.
    """
    import sys

    from megatron.training.arguments import parse_args as megatron_parse_args
    from megatron.training.arguments import validate_args

    provider = _provider(extra_args_provider)
    saved_argv = sys.argv
    sys.argv = [saved_argv[0], *(saved_argv[1:] if argv is None else argv)]
    try:
        args = megatron_parse_args(provider)
    finally:
        sys.argv = saved_argv
    validate_model_given(args)
    validate_batch_invariance(args)
    validate_cuda_graphs(args)
    validate_save_interval(args)
    try:
        with compat.megatron_arguments_dump_deferred():  # printed once the run's inputs are read
            validate_args(args)
    except AssertionError as exc:  # megatron-core's checks are asserts, some without a message
        raise ValueError(f"megatron-core refuses these arguments: {_assertion_text(exc)}") from exc
    return args


def print_arguments(args: argparse.Namespace) -> None:
    """Megatron's dump of every argument, which parse_args holds back: entry points print it once
    the run's inputs are read, so that an input error is the last thing a user sees."""
    compat.print_megatron_arguments(args)


def _assertion_text(exc: AssertionError) -> str:
    """The assertion's message, else the source line that failed (`assert args.x is not None`)."""
    return str(exc) or traceback.extract_tb(exc.__traceback__)[-1].line
