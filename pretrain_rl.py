"""GRPO/DAPO on a Megatron GPT model with megatron-core's DynamicInferenceEngine as the generator.

  torchrun --nproc-per-node 1 pretrain_rl.py --recipe examples/recipes/tiny_sort.yaml \
      --batch-invariant-mode --flash-attention-version 4

Flags: Megatron's own (model, optimizer, --save/--load, --grpo-*, --rl-default-*, ...) plus
megatron_rl_bi's (`python pretrain_rl.py --help`, group "megatron_rl_bi"). Everything that can be
checked without a GPU (flags, recipe, tokenizer, dataset lines) is checked before CUDA is touched.
"""

import argparse

import torch

from megatron_rl_bi.config import engine_config_from_args
from megatron_rl_bi.envs import build_task
from megatron_rl_bi.envs.tokenizer import build_tokenizer
from megatron_rl_bi.inference import Generator
from megatron_rl_bi.models.build import (
    build_ddp_and_optimizer,
    build_model,
    initialize_distributed,
    set_batch_invariance,
)
from megatron_rl_bi.reporting.metrics import MetricsLogger
from megatron_rl_bi.reporting.provenance import provenance
from megatron_rl_bi.rl.checkpoint import load_pretrained_weights
from megatron_rl_bi.rl.loop import LoopConfig, run_rl
from megatron_rl_bi.rl_config import parse_rl_args, rl_configs


def build_reference_model(args: argparse.Namespace, vocab_size: int, policy) -> torch.nn.Module:
    """Frozen copy of the starting policy (--pretrained-checkpoint or the initial weights), for
    --grpo-kl-beta > 0. Built before any resume, so a resumed run has the same reference."""
    reference = build_model(args, vocab_size)
    reference.load_state_dict(policy.state_dict())
    reference.requires_grad_(False)
    return reference


def main(argv: list[str] | None = None) -> None:
    args = parse_rl_args(argv)
    tokenizer = build_tokenizer(args.rl_tokenizer)
    task = build_task(args.rl_task, args.seed, args.rl_dataset)
    rollout_config, step_config, sampling = rl_configs(args, tokenizer.eod)
    engine_config = engine_config_from_args(args)

    initialize_distributed(args.seed)
    set_batch_invariance(args)
    model = build_model(args, tokenizer.vocab_size)
    if args.pretrained_checkpoint:
        load_pretrained_weights(args.pretrained_checkpoint, model)
    ddp, optimizer = build_ddp_and_optimizer(args, model)
    generator = Generator(model, engine_config)
    is_logger = torch.distributed.get_rank() == 0
    logger = None
    if is_logger:
        logger = MetricsLogger(
            total_steps=args.train_iters,
            jsonl_path=args.rl_metrics_jsonl,
            tensorboard_dir=args.tensorboard_dir,
            wandb_project=args.wandb_project or None,
            run_config={k: str(v) for k, v in vars(args).items()},
            run_info=provenance(),
        )
    loop_config = LoopConfig(
        steps=args.train_iters,
        seed=args.seed,
        save_dir=args.save,
        save_interval=args.save_interval or 0,
        load_dir=args.load,
        load_optimizer=not args.no_load_optim,
        sft_warmup_steps=args.rl_sft_warmup_steps,
        sft_batch_size=args.rl_sft_batch_size,
        sft_lr=args.rl_sft_lr,
    )
    reference = None
    if args.grpo_kl_beta > 0:
        reference = build_reference_model(args, tokenizer.vocab_size, model)
    run_rl(ddp=ddp, optimizer=optimizer, generator=generator, task=task, tokenizer=tokenizer,
           rollout_config=rollout_config, step_config=step_config, sampling=sampling,
           config=loop_config, logger=logger, ref_model=reference)
    if logger:
        logger.close()
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
