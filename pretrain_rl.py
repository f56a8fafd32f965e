r"""GRPO/DAPO on a Megatron GPT model with megatron-core's DynamicInferenceEngine as the generator.

  torchrun --nproc-per-node 1 pretrain_rl.py --recipe examples/recipes/tiny_sort.yaml \
      --batch-invariant-mode --flash-attention-version 4

Flags: Megatron's own (model, optimizer, --save/--load, --grpo-*, --rl-default-*, ...) plus
megatron_rl_bi's (`python pretrain_rl.py --help`, group "megatron_rl_bi"). Everything that can be
checked without a GPU (flags, recipe, tokenizer, dataset lines) is checked before CUDA is touched.
"""

import sys

if __name__ == "__main__":  # before the imports below, which the workers' own imports overlap
    from megatron_rl_bi.compiling.workers import start_compile_workers

    COMPILE_WORKERS = start_compile_workers(sys.argv[1:])

import argparse
import dataclasses
import os
import time
from dataclasses import dataclass

import psutil
import torch

from megatron_rl_bi import bi
from megatron_rl_bi.bridge import Bridge, Roles, bridge_address, join_world, roles_from_environment
from megatron_rl_bi.checkpoints.hf import HFModel, check_hf_weights, read_hf_model
from megatron_rl_bi.checkpoints.megatron import latest_checkpoint, read_rl_state, start_save_results_queue
from megatron_rl_bi.compiling.workers import CompileWorkers
from megatron_rl_bi.config import installed_kernel_problem, parse_rl_args, print_arguments
from megatron_rl_bi.config.from_args import (
    build_policy,
    code_sandbox_from_args,
    engine_config_from_args,
    engine_shape,
    levers_from_args,
    loop_config_from_args,
    memory_history_from_args,
    memory_run_from_args,
    model_vocab_size,
    rollout_config_from_args,
    sampling_from_args,
    step_config_from_args,
)
from megatron_rl_bi.distributed import initialize_distributed
from megatron_rl_bi.envs import build_task
from megatron_rl_bi.envs.reward_fn import RewardFnTask, load_reward_fn, with_reward_fn
from megatron_rl_bi.envs.tasks import JsonlTask
from megatron_rl_bi.envs.tokenizer import build_tokenizer
from megatron_rl_bi.envs.tool_format import build_tool_format
from megatron_rl_bi.inference import EngineConfig, Generator
from megatron_rl_bi.launch import launch_check, report_to_torchrun
from megatron_rl_bi.memory import (
    GIB,
    format_plan,
    host_memory_problem,
    host_memory_warning,
    host_optimizer_bytes,
    kv_cache_bytes,
    kv_cache_problem,
    node_memory_bytes,
    optimizer_growth_before_generation,
    parameter_count,
    plan_memory,
)
from megatron_rl_bi.models.build import build_model
from megatron_rl_bi.models.compile_ahead import compile_ahead, compile_ahead_problem
from megatron_rl_bi.optimizer import build_ddp_and_optimizer, build_lr_scheduler
from megatron_rl_bi.reporting.compiles import count_triton_compiles
from megatron_rl_bi.reporting.metrics import MetricsLogger
from megatron_rl_bi.reporting.profiling import start_memory_history
from megatron_rl_bi.reporting.provenance import provenance
from megatron_rl_bi.reporting.samples import SampleWriter
from megatron_rl_bi.rl.generator_apart import rank_batches, rank_validation, serve_generation
from megatron_rl_bi.rl.loop import run_rl
from megatron_rl_bi.rl.optimizer_offload import generating


def build_reference_model(args: argparse.Namespace, policy) -> torch.nn.Module:
    """Frozen copy of the starting policy (--hf-checkpoint, --pretrained-checkpoint or the initial
    weights), for --grpo-kl-beta > 0. Built before any resume, so a resumed run has the same
    reference."""
    # the policy's routers alone record routing (--moe-enable-routing-replay): the engine's
    # record keeps one entry per recording layer
    reference = build_model(argparse.Namespace(**{**vars(args), "moe_enable_routing_replay": False}),
                            args.padded_vocab_size)
    reference.load_state_dict(policy.state_dict())
    reference.requires_grad_(False)
    return reference


def build_logger(args: argparse.Namespace, memory_plan: dict, tokenizer, argv: list[str]) -> MetricsLogger | None:
    """Rank 0 logs, its run header carrying the memory plan (and its rollouts' text with
    --rl-samples-jsonl; in BI mode, the parity doctor's command for `argv` should parity break);
    other ranks get None."""
    if torch.distributed.get_rank() != 0:
        return None
    return MetricsLogger(
        total_steps=args.train_iters,
        jsonl_path=args.rl_metrics_jsonl,
        tensorboard_dir=args.tensorboard_dir,
        wandb_project=args.wandb_project or None,
        run_config={k: str(v) for k, v in vars(args).items()},
        run_info={**provenance(), "memory_plan": memory_plan},
        samples=SampleWriter(args.rl_samples_jsonl, args.rl_samples_per_step, tokenizer.decode)
        if args.rl_samples_jsonl else None,
        doctor_argv=argv if args.batch_invariant_mode else None,
        compiles=count_triton_compiles(),
    )


def size_kv_cache(args: argparse.Namespace, config: EngineConfig, vocab_size: int,
                  generator: bool = False) -> EngineConfig:
    """The engine's config with --rl-kv-cache-memory-fraction of the memory free while it generates
    as its cache: free now (the trainer's state placed), less the optimizer state still to come
    before it generates, plus what leaves the GPU then (--rl-offload-optimizer-during-inference);
    unchanged without the flag. A cache too small for one request is an error naming the flags.
    A `generator` rank apart holds no optimizer: what is free now is what it has."""
    levers = levers_from_args(args)
    if levers.kv_cache_fraction is None:
        return config
    run = memory_run_from_args(args, vocab_size, torch.distributed.get_world_size(), 0, generator)
    growth = 0 if generator else optimizer_growth_before_generation(parameter_count(run.model), run.model, levers,
                                                                     run.data_parallel)
    cached = torch.cuda.memory_reserved() - torch.cuda.memory_allocated()  # torch's, free to reuse
    free = torch.cuda.mem_get_info()[0] + cached - growth
    sized = dataclasses.replace(config, buffer_size_gb=kv_cache_bytes(free, levers, run.engine) / GIB)
    if problem := kv_cache_problem(run.model, engine_shape(sized),
                                   f"--rl-kv-cache-memory-fraction {levers.kv_cache_fraction}"):
        raise ValueError(problem)
    print(f"KV cache: {sized.buffer_size_gb:.2f} GiB = {levers.kv_cache_fraction} x "
          f"{free / GIB:.2f} GiB free while generating", flush=True)
    return sized


def memory_plan(args: argparse.Namespace, vocab_size: int, generator: bool = False) -> dict:
    """The plan of this process on this GPU (a trainer's, or a `generator`'s), printed by rank 0
    of its world (the trainers' world holds the data-parallel trainers only: bridge.join_world);
    its summary for the run header."""
    run = memory_run_from_args(args, vocab_size, torch.distributed.get_world_size(),
                               torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory, generator)
    plan = plan_memory(run, levers_from_args(args))
    if torch.distributed.get_rank() == 0:
        print("memory plan (tools/memory_plan.py):\n" + format_plan(plan), flush=True)
    return plan.summary()


@dataclass
class RunInputs:
    """Everything read and checked before CUDA is touched."""

    args: argparse.Namespace
    tokenizer: object
    vocab_size: int
    engine_config: object
    rollout_config: object
    task: object
    eval_examples: list | None
    hf_model: HFModel | None
    roles: Roles
    argv: list[str]
    kernel_problem: str | None = None
    """With --launch-check: why this node could not run the kernels (the check goes on)."""


def continue_checkpoint_seed(args: argparse.Namespace) -> None:
    """A run resumed from --load keeps the seed its checkpoint was written with: the prompts,
    their order and every step's samples are functions of it, so a requeued job that passes
    another --seed still continues the same run."""
    path = latest_checkpoint(args.load) if args.load else None
    seed = read_rl_state(path)[0].get("seed") if path else None
    if seed is not None and seed != args.seed:
        print(f"--load {path}: continuing with the checkpoint's --seed {seed} (given {args.seed})",
              flush=True)
        args.seed = seed


def read_inputs(argv: list[str] | None) -> RunInputs:
    """Flags, recipe, tokenizer, datasets (every line), reward function, environment, HF config
    and the seed of a checkpoint to resume, each checked: a bad one raises ValueError naming the flag, file
    or line."""
    argv = sys.argv[1:] if argv is None else argv
    args = parse_rl_args(argv)
    kernel_problem = installed_kernel_problem(args)
    continue_checkpoint_seed(args)
    tokenizer = build_tokenizer(args.rl_tokenizer, chat_template=not args.rl_no_chat_template)
    engine_config = engine_config_from_args(args, temperature=args.rl_default_temperature)
    task = build_task(args.rl_task, args.seed, args.rl_dataset, args.rl_env, code_sandbox_from_args(args),
                      warmup=args.rl_sft_warmup_steps > 0)
    eval_task = JsonlTask(args.rl_eval_dataset) if args.rl_eval_dataset else None
    for dataset in (task, eval_task):
        if hasattr(dataset, "check_prompts"):
            dataset.check_prompts(tokenizer.encode_prompt, engine_config.max_prompt_tokens)
    eval_examples = eval_task and eval_task.examples
    if args.rl_reward_fn:
        reward_fn = load_reward_fn(args.rl_reward_fn)
        task = RewardFnTask(task, reward_fn)
        eval_examples = eval_examples and [with_reward_fn(e, reward_fn) for e in eval_examples]
    hf_model = read_hf_model(args.hf_checkpoint) if args.hf_checkpoint else None
    if hf_model:
        check_hf_weights(hf_model)
    vocab_size = model_vocab_size(args, tokenizer)
    check_kv_cache(args, engine_config, vocab_size)
    roles = roles_from_environment(args.rl_generator_ranks)
    check_host_memory(args, vocab_size, roles)
    rollout_config = rollout_config_from_args(args, task)
    if rollout_config.environment:
        build_tool_format(args.rl_tool_format, tokenizer, rollout_config.environment)
    return RunInputs(args, tokenizer, vocab_size, engine_config, rollout_config, task, eval_examples, hf_model,
                     roles, argv, kernel_problem)


def check_kv_cache(args: argparse.Namespace, config: EngineConfig, vocab_size: int) -> None:
    """A configured cache (--inference-dynamic-batching-buffer-size-gb) must hold one request of
    --inference-max-seq-length; a fraction's is checked once the free memory is known."""
    if args.rl_kv_cache_memory_fraction is None:
        run = memory_run_from_args(args, vocab_size, 1, 0)
        if problem := kv_cache_problem(run.model, engine_shape(config),
                                       f"--inference-dynamic-batching-buffer-size-gb {config.buffer_size_gb}"):
            raise ValueError(problem)


def check_host_memory(args: argparse.Namespace, vocab_size: int, roles: Roles) -> None:
    """This node's training processes' optimizers must fit its memory (--optimizer-cpu-offload
    keeps 16 bytes a parameter there): found now, not by the kernel's OOM killer after the model
    is built and a step has run."""
    run = memory_run_from_args(args, vocab_size, roles.trainers, 0)
    host = host_optimizer_bytes(parameter_count(run.model), run.model, levers_from_args(args), run.data_parallel)
    processes = roles.trainers_on_node(int(os.environ.get("LOCAL_WORLD_SIZE", 1)), int(os.environ.get("GROUP_RANK", 0)))
    machine = node_memory_bytes()
    if problem := host_memory_problem(host, processes, machine, args.use_distributed_optimizer):
        raise ValueError(problem)
    if (warning := host_memory_warning(host, processes, machine)) and roles.rank == 0:
        print(warning, flush=True)


def start_processes(inputs: RunInputs) -> Bridge | None:
    """torch.distributed and this process's GPU for its role; with generator ranks
    (--rl-generator-ranks) the bridge between them and the trainers."""
    args, roles = inputs.args, inputs.roles
    if roles.generators:
        join_world(roles, "nccl")
    initialize_distributed(args.seed, cuda_graphs=args.cuda_graph_impl == "local", share_gpus=bool(roles.generators))
    start_memory_history(memory_history_from_args(args))
    if not roles.generators:
        return None
    return Bridge(roles, args.refit_method, args.rl_generator_timeout, *bridge_address())


def generate_apart(inputs: RunInputs, bridge: Bridge) -> None:
    """A generator rank's run: the model built as the trainers build it (its weights come from
    them), its engine, and every batch of the trainer ranks it serves."""
    args, tokenizer = inputs.args, inputs.tokenizer
    with bi.batch_invariant(args.batch_invariant_mode):
        model = build_model(args, inputs.vocab_size)
        memory_plan(args, inputs.vocab_size, generator=True)
        try:
            engine_config = size_kv_cache(args, inputs.engine_config, inputs.vocab_size, generator=True)
        except ValueError as exc:
            raise SystemExit(f"pretrain_rl.py: error: {exc}") from None
        engine, sampling = Generator(model, engine_config), sampling_from_args(args, tokenizer.eod)
        validate = inputs.eval_examples and rank_validation(engine, inputs.eval_examples, tokenizer, sampling,
                                                            args.seed, inputs.rollout_config, inputs.roles.trainers)
        serve_generation(bridge, model, inputs.task, args.seed,
                         rank_batches(engine, tokenizer, sampling, inputs.rollout_config), validate or None)


def seconds_before_main(started: float) -> float:
    """Seconds from this process's start until main read `started` (its perf_counter): the
    interpreter's start-up and every import before main. The warm tiny hybrid run reached main
    about 21 s after torchrun was started (H100, bench/first_step.py at 279dfc6)."""
    main_started = time.time() - (time.perf_counter() - started)
    return main_started - psutil.Process().create_time()


def compiling_ahead(args: argparse.Namespace) -> bool:
    """BI mode with --rl-compile-ahead-workers above 0 (models/compile_ahead.py: why BI only)."""
    return args.batch_invariant_mode and args.rl_compile_ahead_workers > 0


def compile_kernels_ahead(args: argparse.Namespace, ddp, workers: CompileWorkers | None, vocab_size: int,
                          engine: EngineConfig | None) -> dict:
    """The trainer's kernels, and those of the `engine` on its module (None: generators apart),
    compiled by the workers before the first step (models/compile_ahead.py), then the workers
    ended. Returns the first step's record fields: the seconds it took, of them those spent
    waiting for the workers after the pass, and where the pass ran, the workers' jobs and their
    compiling seconds summed. A failure is printed and leaves the kernels to the first step."""
    if not compiling_ahead(args):
        return {"time/startup_compile_ahead_s": 0.0, "time/startup_compile_ahead_wait_s": 0.0}
    started, outcome = time.perf_counter(), None
    try:
        if problem := compile_ahead_problem(ddp):
            if workers is not None:
                print(f"compile ahead: off ({problem}): the first step compiles the kernels", flush=True)
        else:
            engine_pages = (engine.block_size_tokens, engine.max_sequence_length) if engine is not None else None
            outcome = compile_ahead(ddp, workers, vocab_size, args.seq_length, engine_pages)
    except Exception as exc:  # an optimization: the run goes on and compiles in its first step
        print(f"compile ahead: failed ({type(exc).__name__}: {exc}): the first step compiles the kernels", flush=True)
    finally:
        if workers is not None:
            workers.close()
    if outcome is not None:
        failed = f", the first: {outcome['failed'][0]}" if outcome["failed"] else ""
        longest = f", the longest {outcome['longest']['seconds']:.1f} s: {outcome['longest']['name']}" \
            if outcome["longest"] else ""
        print(f"compile ahead: {outcome['jobs']} kernels in {len(workers.processes)} processes "
              f"({outcome['compile_s']:.1f} s of compiling{longest}), {len(outcome['failed'])} failed{failed}; "
              f"waited {outcome['wall_s']:.1f} s", flush=True)
    record = {"time/startup_compile_ahead_s": time.perf_counter() - started,
              "time/startup_compile_ahead_wait_s": outcome["wall_s"] if outcome is not None else 0.0}
    if outcome is not None:
        record.update({"compile_ahead/jobs": outcome["jobs"], "time/compile_ahead_workers_s": outcome["compile_s"]})
    return record


def train(inputs: RunInputs, bridge: Bridge | None, started: float, workers: CompileWorkers | None) -> None:
    """A trainer rank's run: the policy, its optimizer and, unless generators are apart, the
    engine on the same module; then the RL loop. The first step's record carries the start-up's
    phases: the imports before `started` (main's perf_counter), and each phase after it."""
    args, tokenizer, task, hf_model = inputs.args, inputs.tokenizer, inputs.task, inputs.hf_model
    with bi.batch_invariant(args.batch_invariant_mode):
        model = build_policy(args, inputs.vocab_size, hf_model)
        ddp, optimizer = build_ddp_and_optimizer(args, model)
        lr_scheduler = build_lr_scheduler(args, optimizer)
        reference = build_reference_model(args, model) if args.grpo_kl_beta > 0 else None
        model_built = time.perf_counter()
        compile_ahead_record = compile_kernels_ahead(
            args, ddp, workers, inputs.vocab_size, inputs.engine_config if bridge is None else None)
        generator, compiled = None, time.perf_counter()
        if bridge is None:
            try:
                engine_config = size_kv_cache(args, inputs.engine_config, inputs.vocab_size)
            except ValueError as exc:  # the cache holds no request: before any generation
                raise SystemExit(f"pretrain_rl.py: error: {exc}") from None
            with generating(optimizer, args.rl_offload_optimizer_during_inference):
                generator = Generator(model, engine_config)  # its cache sized for this phase
        engine_built = time.perf_counter()
        logger = build_logger(args, memory_plan(args, inputs.vocab_size), tokenizer, inputs.argv)
        if logger:
            logger.add_to_next_record({"time/startup_imports_s": seconds_before_main(started),
                                       "time/startup_model_s": model_built - started,
                                       **compile_ahead_record,
                                       "time/startup_engine_s": engine_built - compiled})
        run_rl(ddp=ddp, optimizer=optimizer, generator=generator, task=task, tokenizer=tokenizer,
               rollout_config=inputs.rollout_config,
               step_config=step_config_from_args(args),
               sampling=sampling_from_args(args, tokenizer.eod), config=loop_config_from_args(args),
               logger=logger, ref_model=reference, lr_scheduler=lr_scheduler, hf_model=hf_model,
               eval_examples=inputs.eval_examples, bridge=bridge)
    if logger:
        logger.close()
    torch.distributed.barrier()


def main(argv: list[str] | None = None, compile_workers: CompileWorkers | None = None) -> None:
    """`compile_workers`: those started before the imports (--rl-compile-ahead-workers), if any."""
    started = time.perf_counter()
    count_triton_compiles()  # from the start: the first step's record counts the start-up's
    start_save_results_queue()  # forked while this process has one thread and no CUDA
    try:
        inputs = read_inputs(argv)
    except ValueError as exc:  # bad input: the message names it, a traceback would bury it
        report_to_torchrun(f"pretrain_rl.py: error: {exc}")
        raise SystemExit(f"pretrain_rl.py: error: {exc}") from None
    print_arguments(inputs.args)
    unused = inputs.args.launch_check or inputs.roles.is_generator or not compiling_ahead(inputs.args)
    if compile_workers is not None and unused:
        compile_workers.close()
        compile_workers = None
    if inputs.args.launch_check:
        launch_check(inputs.args.load, inputs.kernel_problem, inputs.args.rl_generator_ranks)
        return
    bridge = start_processes(inputs)
    if inputs.roles.is_generator:
        generate_apart(inputs, bridge)
    else:
        train(inputs, bridge, started, compile_workers)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(compile_workers=COMPILE_WORKERS)
