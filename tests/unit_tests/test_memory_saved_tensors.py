"""The planner's activations per token (memory.activation_bytes_per_token) against what
megatron-core's layers save for their backward, counted on CPU in BI mode (the kernels' Python
is the GPU's, run by the Triton interpreter): every tensor autograd saves during the trainer's
forward and keeps for the backward, once per storage, parameters left out, summed per layer. Per token exactly: two
micro-batches of the same three sequences at different lengths, so what is saved per sequence
(GDN initial states, convolution windows) cancels. Attention runs a FlashAttention stand-in that
saves what FlashAttention's varlen function saves (q, k, v, output, fp32 log-sum-exp)."""

import collections
import weakref

import pytest
import torch

from megatron_rl_bi import bi, memory
from megatron_rl_bi.attention import flash
from megatron_rl_bi.config import parse_rl_args
from megatron_rl_bi.config.from_args import model_shape_from_args
from megatron_rl_bi.models.build import build_model
from megatron_rl_bi.models.logprobs import forward_logprobs
from megatron_rl_bi.packing import pack_sequences
from tests.unit_tests.conftest import torch_varlen_attention

VOCAB = 40
COMMON = ["--hidden-size", "64", "--ffn-hidden-size", "96", "--num-attention-heads", "8", "--group-query-attention",
          "--num-query-groups", "2", "--kv-channels", "16", "--swiglu", "--disable-bias-linear", "--bf16",
          "--seq-length", "256", "--max-position-embeddings", "256", "--use-cpu-initialization",
          "--no-initialization", "--transformer-impl", "local", "--flash-attention-version", "4"]
MODELS = {
    "dense": ["--num-layers", "2"],
    "dense, QK norm, partial RoPE": ["--num-layers", "2", "--qk-layernorm", "--rotary-percent", "0.5"],
    # Qwen3.5's kinds of layer: GDN, and attention with QK norm, partial RoPE and an output gate
    "hybrid": ["--hybrid-layer-pattern", "G-*-", "--linear-num-key-heads", "2", "--linear-num-value-heads", "4",
               "--linear-key-head-dim", "8", "--linear-value-head-dim", "8", "--linear-conv-kernel-dim", "4",
               "--qk-layernorm", "--rotary-percent", "0.25", "--attention-output-gate"],
    # MoE layers (models.moe): routed experts with a shared one, the load-balancing loss, fp32 router
    "dense-MoE": ["--num-layers", "2", "--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "40",
                  "--moe-shared-expert-intermediate-size", "24", "--moe-aux-loss-coeff", "0.01",
                  "--moe-router-dtype", "fp32"],
    # top 3, the z-loss without a load-balancing loss, bf16 router; GDN and attention between
    "hybrid GDN-MoE": ["--hybrid-layer-pattern", "GE*E", "--linear-num-key-heads", "2", "--linear-num-value-heads", "4",
                       "--linear-key-head-dim", "8", "--linear-value-head-dim", "8", "--linear-conv-kernel-dim", "4",
                       "--num-experts", "6", "--moe-router-topk", "3", "--moe-ffn-hidden-size", "40",
                       "--moe-z-loss-coeff", "0.001"],
    # Qwen3.5-MoE's MLP: a shared expert scaled by the sigmoid of its own gate
    "hybrid GDN-MoE, gated shared expert": [
        "--hybrid-layer-pattern", "GE*E", "--linear-num-key-heads", "2", "--linear-num-value-heads", "4",
        "--linear-key-head-dim", "8", "--linear-value-head-dim", "8", "--linear-conv-kernel-dim", "4",
        "--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "40",
        "--moe-shared-expert-intermediate-size", "24", "--moe-shared-expert-gate"],
}


class _FlashAttentionSaves(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens, scale):
        out = torch_varlen_attention(q, k, v, cu_seqlens_q=cu_seqlens, softmax_scale=scale, causal=True)
        ctx.save_for_backward(q, k, v, out, torch.empty(q.shape[1], q.shape[0], dtype=torch.float32))
        return out

    @staticmethod
    def backward(ctx, grad):
        raise NotImplementedError("only the forward's saved tensors are counted")


def _flash_attention(q, k, v, cu_seqlens_q, softmax_scale, **unused):
    return _FlashAttentionSaves.apply(q, k, v, cu_seqlens_q, softmax_scale), None


class _Saved:
    """What a saved-tensor hook packs: alive as long as autograd keeps the tensor for the backward
    (a node whose output nobody uses is freed during the forward, and its saved tensors with it)."""

    def __init__(self, tensor):
        self.tensor = tensor


def _saved_bytes_per_layer(model, sequences) -> dict[int, int]:
    """Bytes of the distinct storages autograd keeps from each decoder layer's forward."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    layer_stack, saved = [None], []
    for name, module in model.named_modules():
        if name.split(".")[-2:-1] == ["layers"]:
            module.register_forward_pre_hook(lambda m, a, index=int(name.split(".")[-1]): layer_stack.append(index))
            module.register_forward_hook(lambda m, a, o: (layer_stack.pop(), None)[1])

    def pack(tensor):
        packed = _Saved(tensor)
        if layer_stack[-1] is not None and tensor.untyped_storage().data_ptr() not in params:
            saved.append((layer_stack[-1], weakref.ref(packed)))
        return packed

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda packed: packed.tensor):
        logprobs, _ = forward_logprobs(model, pack_sequences(sequences))
        storages = {}
        for layer, ref in saved:
            if (packed := ref()) is not None:
                storage = packed.tensor.untyped_storage()
                storages.setdefault(storage.data_ptr(), (layer, storage.nbytes()))
        del logprobs
    per_layer = collections.Counter()
    for layer, nbytes in storages.values():
        per_layer[layer] += nbytes
    return dict(per_layer)


@pytest.mark.parametrize("flags", MODELS.values(), ids=list(MODELS))
def test_each_layer_saves_what_the_plan_counts_per_token(cpu_forward, cpu_dispatch, monkeypatch, flags):
    monkeypatch.setattr(flash, "flash_varlen_function", lambda version: _flash_attention)
    args = parse_rl_args(COMMON + flags)
    shape = model_shape_from_args(args, VOCAB)
    with bi.batch_invariant(True):
        model = build_model(args, VOCAB)
        short, long = ([[t % 30 + 1 for t in range(n * length)] for n in (1, 2, 3)] for length in (10, 18))
        before, after = _saved_bytes_per_layer(model, short), _saved_bytes_per_layer(model, long)
    tokens = 6 * (18 - 10)
    per_token = {layer: (after[layer] - before[layer]) / tokens for layer in after}
    planned = {index: sum(memory.activation_bytes_per_token(shape, symbol) for symbol in layer)
               for index, layer in enumerate(shape.layers)}
    assert per_token == planned


def test_a_built_model_runs_the_fused_rope_and_the_one_call_packed_rope(cpu_forward, cpu_dispatch, monkeypatch):
    from megatron.core.models.common.embeddings import rope_utils

    from megatron_rl_bi.models import rope

    monkeypatch.setattr(flash, "flash_varlen_function", lambda version: _flash_attention)
    # as before any build: megatron-core's own functions in place
    monkeypatch.setattr(rope_utils, "_apply_rotary_pos_emb_bshd", rope.megatron_cores_rope())
    monkeypatch.setattr(rope_utils, "_apply_rotary_pos_emb_thd", lambda *args, **kwargs: None)
    with bi.batch_invariant(True):
        build_model(parse_rl_args(COMMON + MODELS["dense"]), VOCAB)
    assert rope_utils._apply_rotary_pos_emb_bshd.upstream is rope.megatron_cores_rope()
    assert rope_utils._apply_rotary_pos_emb_thd.one_call
