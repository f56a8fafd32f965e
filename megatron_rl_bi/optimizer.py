"""Megatron DDP, optimizer and learning-rate schedule around the model, from Megatron's own flags."""

import argparse

import torch


def build_ddp_and_optimizer(args: argparse.Namespace, model: torch.nn.Module):
    """Megatron DDP + Megatron optimizer (fp32 main params under --bf16).

    Gradients are summed, not averaged, over data-parallel ranks (calculate_per_token_loss): the
    RL loss is already normalized by global counts.
    """
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.optimizer import get_megatron_optimizer
    from megatron.training.training import get_megatron_ddp_config, get_megatron_optimizer_config

    if not model.config.calculate_per_token_loss:
        raise ValueError("the RL loss needs --calculate-per-token-loss (summed DP gradients)")
    ddp = DistributedDataParallel(model.config, get_megatron_ddp_config(args), model)
    optimizer_config, overrides = get_megatron_optimizer_config(args)
    optimizer = get_megatron_optimizer(optimizer_config, [ddp], config_overrides=overrides)
    return ddp, optimizer


def build_lr_scheduler(args: argparse.Namespace, optimizer):
    """megatron-core's OptimizerParamScheduler from Megatron's flags (--lr, --min-lr,
    --lr-decay-style, --lr-decay-iters, --lr-warmup-iters / --lr-warmup-fraction,
    --lr-warmup-init, --lr-wsd-*, --start-weight-decay, --end-weight-decay,
    --weight-decay-incr-style).

    It counts optimizer updates, stepped once per update: an RL step (what --train-iters and the
    other *-iters flags count) makes --grpo-iterations updates, so those flags are scaled by it.
    This package's default --lr-decay-style is constant (Megatron's is linear).
    """
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    updates = args.grpo_iterations
    decay_steps = (args.lr_decay_iters or args.train_iters) * updates
    if args.lr_warmup_fraction is not None:
        warmup_steps = args.lr_warmup_fraction * decay_steps
    else:
        warmup_steps = args.lr_warmup_iters * updates
    return OptimizerParamScheduler(
        optimizer,
        init_lr=args.lr_warmup_init,
        max_lr=args.lr,
        min_lr=args.min_lr,
        lr_warmup_steps=warmup_steps,
        lr_decay_steps=decay_steps,
        lr_decay_style=args.lr_decay_style,
        start_wd=args.start_weight_decay,
        end_wd=args.end_weight_decay,
        wd_incr_steps=args.train_iters * updates,
        wd_incr_style=args.weight_decay_incr_style,
        use_checkpoint_opt_param_scheduler=args.use_checkpoint_opt_param_scheduler,
        override_opt_param_scheduler=args.override_opt_param_scheduler,
        wsd_decay_steps=args.lr_wsd_decay_iters * updates if args.lr_wsd_decay_iters else None,
        lr_wsd_decay_style=args.lr_wsd_decay_style,
    )
