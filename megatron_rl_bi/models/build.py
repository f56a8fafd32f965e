"""Model construction (dense GPT or hybrid GDN) from parsed Megatron arguments.

The kernel mode comes from the BI switch, not from `args`: the model's
`TransformerConfig.batch_invariant_mode` (read by megatron-core's engine attention at
construction) is set to whatever the switch says when the model is built, so config and switch
agree by construction. Callers set the switch (`bi.batch_invariant(on)`) before building.
"""

import argparse

import torch
from megatron.core.models.gpt import GPTModel
from megatron.core.models.hybrid.hybrid_model import HybridModel
from megatron.core.transformer.attention import Attention
from megatron.core.transformer.module import Float16Module
from megatron.training.vocab_utils import calculate_padded_vocab_size

from megatron_rl_bi import bi, compat
from megatron_rl_bi.models.gpt_spec import dense_gpt_block_spec
from megatron_rl_bi.models.hybrid_spec import hybrid_stack_spec
from megatron_rl_bi.models.moe import forget_routing_recorders, start_recording_routing
from megatron_rl_bi.models.norm import RMSNorm
from megatron_rl_bi.models.rope import use_fused_rope


def build_model(args: argparse.Namespace, vocab_size: int) -> torch.nn.Module:
    """The model on the current GPU, bf16 params under --bf16 (Megatron's Float16Module): a
    hybrid GDN/attention/MLP stack when --hybrid-layer-pattern is given, else a dense GPT."""
    compat.one_call_packed_rope()
    use_fused_rope()
    compat.fa4_hopper_without_split_kv()
    args.padded_vocab_size = calculate_padded_vocab_size(
        vocab_size, args.make_vocab_size_divisible_by, 1, logging_enabled=False
    )
    config = compat.transformer_config_with_engine_graphs(
        argparse.Namespace(**{**vars(args), "batch_invariant_mode": bi.enabled()})
    )
    # megatron-core initializes the MoE router's weights on the CPU, from torch's default
    # generator, which megatron-core's CUDA seeding leaves alone: seeded here, they follow --seed
    # and not whatever drew from that generator earlier in the process.
    torch.random.default_generator.manual_seed(args.seed)
    if args.moe_enable_routing_replay:
        forget_routing_recorders()
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
        spec = hybrid_stack_spec(args.transformer_impl, args.qk_layernorm)
        # megatron-core builds the stack's final norm as TENorm: right with TE, RMSNorm without
        final_norm = RMSNorm if args.transformer_impl == "local" else None
        with compat.hybrid_stack_final_norm(final_norm):
            model = HybridModel(hybrid_stack_spec=spec, hybrid_layer_pattern=args.hybrid_layer_pattern,
                                **common)
    else:
        model = GPTModel(
            transformer_layer_spec=dense_gpt_block_spec(
                config, args.transformer_impl, args.qk_layernorm
            ),
            **common,
        )
    model.to(torch.cuda.current_device())
    for module in model.modules():  # megatron-core's engine attention picks its KV splits by this
        if isinstance(module, Attention):
            module.batch_invariant_mode = bi.enabled("attention_split")
    if args.moe_enable_routing_replay:
        start_recording_routing()
    if args.bf16 or args.fp16:
        model = Float16Module(config, model)
    return model


def cpu_state_dict(model: torch.nn.Module) -> dict:
    """A CPU copy of the model's weights (non-tensor extra state as is), to build the same model
    again in another kernel mode."""
    return {k: v.detach().cpu().clone() if torch.is_tensor(v) else v
            for k, v in model.state_dict().items()}
