"""Megatron DDP and optimizer around the model, from Megatron's own flags."""

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
