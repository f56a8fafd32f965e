"""Process setup and model construction (dense GPT or hybrid GDN) from parsed Megatron arguments.

The BI switch is set here, once, before the model is built: megatron-core's engine attention reads
`config.batch_invariant_mode` at construction, so config and switch always agree.
"""

import argparse
import os

import torch
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.models.hybrid.hybrid_model import HybridModel
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron.core.transformer.module import Float16Module
from megatron.training.argument_utils import core_transformer_config_from_args
from megatron.training.vocab_utils import calculate_padded_vocab_size

from megatron_rl_bi import bi, compat
from megatron_rl_bi.models.gpt_spec import dense_gpt_block_spec
from megatron_rl_bi.models.hybrid_spec import local_hybrid_stack_spec
from megatron_rl_bi.models.norm import RMSNorm


def initialize_distributed(seed: int) -> None:
    """One process per GPU (torchrun or a single plain process); TP = PP = 1."""
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local_rank)
    if not torch.distributed.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29500")
        torch.distributed.init_process_group(
            "nccl",
            rank=int(os.environ.get("RANK", 0)),
            world_size=int(os.environ.get("WORLD_SIZE", 1)),
        )
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=1, pipeline_model_parallel_size=1
        )
    model_parallel_cuda_manual_seed(seed)


def set_batch_invariance(args: argparse.Namespace) -> None:
    bi.enable() if args.batch_invariant_mode else bi.disable()


def build_model(args: argparse.Namespace, vocab_size: int) -> torch.nn.Module:
    """The model on the current GPU, bf16 params under --bf16 (Megatron's Float16Module): a
    hybrid GDN/attention/MLP stack when --hybrid-layer-pattern is given, else a dense GPT."""
    if args.batch_invariant_mode != bi.enabled():
        raise RuntimeError("call set_batch_invariance(args) before build_model")
    args.padded_vocab_size = calculate_padded_vocab_size(
        vocab_size, args.make_vocab_size_divisible_by, 1, logging_enabled=False
    )
    config = core_transformer_config_from_args(args)
    common = dict(
        config=config,
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
        rotary_percent=args.rotary_percent,
        rotary_base=args.rotary_base,
    )
    if args.hybrid_layer_pattern:
        if args.transformer_impl != "local":
            raise ValueError("--hybrid-layer-pattern: only --transformer-impl local is supported")
        with compat.hybrid_stack_final_norm(RMSNorm):
            model = HybridModel(
                hybrid_stack_spec=local_hybrid_stack_spec(),
                hybrid_layer_pattern=args.hybrid_layer_pattern,
                **common,
            )
    else:
        model = GPTModel(
            transformer_layer_spec=dense_gpt_block_spec(
                config, args.transformer_impl, args.qk_layernorm
            ),
            **common,
        )
    model.cuda(torch.cuda.current_device())
    if args.bf16 or args.fp16:
        model = Float16Module(config, model)
    return model


def cpu_state_dict(model: torch.nn.Module) -> dict:
    """A CPU copy of the model's weights (non-tensor extra state as is), to build the same model
    again in another kernel mode."""
    return {k: v.detach().cpu().clone() if torch.is_tensor(v) else v
            for k, v in model.state_dict().items()}


def build_ddp_and_optimizer(args: argparse.Namespace, model: torch.nn.Module):
    """Megatron DDP + Megatron optimizer (fp32 main params under --bf16), from Megatron flags.

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
