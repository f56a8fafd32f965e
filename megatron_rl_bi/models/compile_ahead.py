"""The trainer's kernels compiled side by side before its first step (issue 48's first step).

A forward and backward of the policy on made-up packed batches in which nothing compiles or
launches: Triton's `jit_cache_hook` sends each new launch's specialization to the compile workers
(compiling/workers.py) and skips it, and each FlashAttention-4 call is sent with its shapes and
answered with an empty tensor; before them, the engine's kernels: its FlashAttention-4 calls,
made by megatron-core's own decode-and-prefill attention on a made-up paged cache, its KV appends
and GDN state stores. What the pass computes is garbage and goes nowhere: no gradient is
synchronized (DDP's no_sync), the gradient buffer is zeroed after, the RNG states are restored,
and autotuners keep no pick (bi.autotune.picks_not_kept). Once the workers are done, the run's
first step loads their kernels (and Triton's launchers for them) from Triton's and
FlashAttention-4's disk caches.

BI mode only: there an autotuner tries its candidates in order, untimed (bi/autotune.py); in
default mode it would time launches that do not run.
"""

import contextlib
import itertools
import json

import torch
from megatron.core.inference.contexts.fused_kv_append_kernel import triton_append_key_value_cache
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
from megatron.core.transformer import attention as megatron_attention
from megatron.core.utils import unwrap_model
from triton import knobs
from triton.runtime import driver

from megatron_rl_bi.attention.flash import FlashCoreAttention
from megatron_rl_bi.bi import autotune
from megatron_rl_bi.models.gdn import SwitchedGatedDeltaNet
from megatron_rl_bi.models.logprobs import forward_logprobs
from megatron_rl_bi.packing import PackedBatch, pack_sequences

# The pass's batches: (sequences, the first one's length, the token count modulo 16). Triton
# compiles an integer argument apart when it is a multiple of 16 (a token count, a count of
# sequences or of chunks), FlashAttention-4 a batch whose sequences fit one block apart, and the
# BI GEMM takes its tile by the token count (bi.gemm.TILE_CONFIGS: up to 64 rows, as in a decode
# step, up to 256, more): the batches meet each class of each, the first four in each pairing of
# the two counts' classes, however short the model's sequences (36 of 8 tokens are over 256).
DRY_SHAPES = ((37, 300, 5), (37, 300, 0), (16, 8, 5), (16, 8, 0), (1, 8, 8), (2, 8, 0))


def dry_lengths(sequences: int, longest: int, residue: int, max_length: int) -> list[int]:
    """`sequences` lengths: the first `longest`, the others 8 tokens and the last grown by up to
    15 to make the total `residue` modulo 16; none over `max_length` (a position past the model's
    table would stop the GPU), the residue then as it comes."""
    lengths = [min(longest, max_length)] + [8] * (sequences - 1)
    lengths[-1] += (residue - sum(lengths)) % 16
    return [min(length, max_length) for length in lengths]


def dry_batches(vocab_size: int, max_length: int) -> list[PackedBatch]:
    """The pass's packed batches (DRY_SHAPES), of made-up token ids."""
    return [pack_sequences([[(7 * i + 3) % vocab_size for i in range(length)]
                            for length in dry_lengths(*shape, max_length)]) for shape in DRY_SHAPES]


class KernelSender:
    """Sends each kernel the pass meets to `workers` once (None: sends nothing, as on a node's
    other processes, whose first process's workers compile for them)."""

    def __init__(self, workers, target):
        self.workers, self.sent = workers, set()
        self.target = (target.backend, target.arch, target.warp_size)  # Triton's GPUTarget

    def send(self, job: dict) -> None:
        identity = json.dumps(job, sort_keys=True)
        if self.workers is not None and identity not in self.sent:
            self.sent.add(identity)
            self.workers.submit(job)

    def triton_launch(self, *, fn, compile, **_) -> bool:
        """Triton's jit_cache_hook: the launch's specialization sent; True skips its compilation
        and launch."""
        self.send({"kind": "triton", "name": f"{fn.module}.{fn.name}", "target": self.target,
                   "specialization": compile["specialization_data"]})
        return True

    def flash_attention(self, q, k, v, **kwargs) -> torch.Tensor:
        """A FlashAttention-4 varlen call sent: its forward, and its backward as a job of its own
        when it has one; an empty output. The jobs go before the Triton ones (they are the
        longest), and those of one class (the same but for the token counts) after its first."""
        grad = torch.is_grad_enabled() and q.requires_grad
        tensors, kwargs = {"q": _described(q), "k": _described(k), "v": _described(v)}, {
            name: _described(x) if torch.is_tensor(x) else x for name, x in kwargs.items()}
        for part in ("forward", "backward") if grad else ("forward",):
            self.send({"kind": "flash_attention", "part": part, "grad": grad,
                       "name": f"flash_attn.cute varlen {part} q{list(q.shape)} k{list(k.shape)}",
                       "tensors": tensors, "kwargs": kwargs, "first": True,
                       "kernel_class": _attention_class(part, grad, tensors, kwargs)})
        return _SkippedAttention.apply(q, k, v)


def _described(t: torch.Tensor) -> dict:
    """A tensor as a job gives it: integers by value, others by shape, strides and dtype."""
    if t.dtype in (torch.int32, torch.int64):
        return {"values": t.tolist(), "dtype": str(t.dtype).removeprefix("torch.")}
    return {"shape": list(t.shape), "stride": list(t.stride()), "dtype": str(t.dtype).removeprefix("torch.")}


def _attention_class(part: str, grad: bool, tensors: dict, kwargs: dict) -> str:
    """What a FlashAttention-4 job is but for its token and sequence counts: the calls of one
    class mostly compile one kernel (the others then load it)."""
    def shapeless(description):
        if not isinstance(description, dict):
            return description
        if "values" in description:
            return {"dtype": description["dtype"]}
        return {**description, "shape": description["shape"][1:], "stride": description["stride"][1:]}
    return json.dumps([part, grad, {n: shapeless(t) for n, t in tensors.items()},
                       {n: shapeless(x) for n, x in kwargs.items()}], sort_keys=True)


class _SkippedAttention(torch.autograd.Function):
    """Attention that computes nothing, forward or backward: tensors of the right shapes."""

    @staticmethod
    def forward(ctx, q, k, v):
        ctx.save_for_backward(q, k, v)
        return q.new_empty(*q.shape[:-1], v.shape[-1])

    @staticmethod
    def backward(ctx, grad):
        return tuple(torch.empty_like(t) for t in ctx.saved_tensors)


def engine_steps(max_length: int) -> tuple:
    """The engine's steps whose attention the pass sends: (query lengths, key lengths, decode
    only) of a prefill of a long and a short prompt, of two short ones, and of a decode step; none
    longer than the engine's `max_length`."""
    long = min(300, max_length - 1)
    return (((long, 8), (long, 8), False), ((8, 8), (8, 8), False), ((1, 1), (long + 1, 9), True))


@contextlib.contextmanager
def _engine_flash_attention_sent(sender: KernelSender):
    """megatron-core's FlashAttention-4 function, the one its engine's attention calls, sends its
    calls to `sender` (an empty output, no log-sum-exp)."""
    replaced = megatron_attention.flash_attn4_varlen_func
    megatron_attention.flash_attn4_varlen_func = lambda q, k, v, **kwargs: (sender.flash_attention(q, k, v, **kwargs),
                                                                            None)
    try:
        yield
    finally:
        megatron_attention.flash_attn4_varlen_func = replaced


def _engine_step_attention(layer, query_lengths, key_lengths, decode_only: bool, block_size: int, width: int):
    """`layer`'s attention in one engine step (engine_steps) over a made-up KV cache: pages of
    `block_size` tokens, `width` of them a request."""
    device, dtype, requests = torch.cuda.current_device(), layer.config.params_dtype, len(query_lengths)
    heads, groups = layer.num_attention_heads_per_partition, layer.num_query_groups_per_partition
    channels = layer.hidden_size_per_attention_head
    q = torch.empty(sum(query_lengths), 1, heads, channels, dtype=dtype, device=device)
    k, v = (torch.empty(requests * width, block_size, groups, channels, dtype=dtype, device=device) for _ in "kv")
    cu_q, cu_k = (torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=device)
                  for lengths in (query_lengths, key_lengths))
    table = torch.arange(requests * width, dtype=torch.int32, device=device).view(requests, width)
    layer.flash_decode_and_prefill(q, k, v, max(query_lengths), max(key_lengths), cu_q, cu_k, cu_k.diff(), table,
                                   decode_only)


def send_engine_attention(model: torch.nn.Module, sender: KernelSender, block_size: int, max_length: int) -> None:
    """The engine's FlashAttention-4 calls, which the trainer never makes, sent: megatron-core's
    `Attention.flash_decode_and_prefill` of each attention layer, in eval mode, over a made-up
    KV cache of the engine's pages (`block_size` tokens; a block table as wide as a request of
    `max_length` tokens needs), its FlashAttention-4 call sent instead of run."""
    layers = [m for m in unwrap_model(model).modules()
              if isinstance(m, megatron_attention.Attention) and m.flash_attention_version == 4]
    if not layers:  # FlashAttention-3's kernels come compiled; megatron-core then has no FA4 function
        return
    width = -(-max_length // block_size)
    with _engine_flash_attention_sent(sender), torch.no_grad(), _in_eval(layers):
        for layer in layers:
            for step in engine_steps(max_length):
                _engine_step_attention(layer, *step, block_size, width)


# The token counts of an engine step's KV append: one, a multiple of 16 and another, which Triton
# compiles apart.
APPENDED_TOKENS = (1, 16, 17)


def _engine_kv_append(layer, tokens: int, block_size: int) -> None:
    """megatron-core's KV append (an engine step's keys and values into its paged cache) of
    `tokens` tokens of `layer`, into a made-up cache of one page: a layer's slice of the engine's
    cache has the same strides whatever its page count."""
    device, dtype = torch.cuda.current_device(), layer.config.params_dtype
    heads = (layer.num_query_groups_per_partition, layer.hidden_size_per_attention_head)
    key, value = (torch.empty(tokens, 1, *heads, dtype=dtype, device=device) for _ in "kv")
    cache = torch.empty(2, 1, 1, block_size, *heads, dtype=dtype, device=device)
    pages = torch.zeros(tokens, dtype=torch.int64, device=device)
    positions = torch.zeros(tokens, dtype=torch.int32, device=device)
    triton_append_key_value_cache(0, key, value, cache, tokens, pages, positions)


def send_engine_kernels(model: torch.nn.Module, sender: KernelSender, block_size: int, max_length: int) -> None:
    """The kernels the engine launches and the trainer never does, sent: its FlashAttention-4
    calls (send_engine_attention), each attention layer's KV append, each GDN layer's state
    stores (SwitchedGatedDeltaNet.dry_state_stores); made-up tensors, in eval mode."""
    send_engine_attention(model, sender, block_size, max_length)
    modules = list(unwrap_model(model).modules())
    attention = [m for m in modules if isinstance(m, megatron_attention.Attention)]
    gdn = [m for m in modules if isinstance(m, SwitchedGatedDeltaNet)]
    with torch.no_grad(), _in_eval(attention + gdn):
        for layer in attention:
            for tokens in APPENDED_TOKENS:
                _engine_kv_append(layer, tokens, block_size)
        for layer in gdn:
            layer.dry_state_stores(torch.cuda.current_device())


@contextlib.contextmanager
def _in_eval(layers: list):
    """`layers` in eval mode, each put back in its own mode after."""
    training = [layer.training for layer in layers]
    for layer in layers:
        layer.eval()
    try:
        yield
    finally:
        for layer, mode in zip(layers, training):
            layer.train(mode)


def flash_attention_4_cores(model: torch.nn.Module) -> list[FlashCoreAttention]:
    return [m for m in model.modules() if isinstance(m, FlashCoreAttention) and m.version == 4]


@contextlib.contextmanager
def sending(cores: list, sender: KernelSender):
    """Triton's launches and the FlashAttention-4 calls of `cores` go to `sender`."""
    replaced_hook, replaced_cores = knobs.runtime.jit_cache_hook, [core.varlen for core in cores]
    knobs.runtime.jit_cache_hook = sender.triton_launch
    for core in cores:
        core.varlen = sender.flash_attention
    try:
        yield
    finally:
        knobs.runtime.jit_cache_hook = replaced_hook
        for core, varlen in zip(cores, replaced_cores):
            core.varlen = varlen


@contextlib.contextmanager
def _rng_kept():
    cpu, cuda, tracker = torch.get_rng_state(), torch.cuda.get_rng_state(), get_cuda_rng_tracker().get_states()
    try:
        yield
    finally:
        torch.set_rng_state(cpu)
        torch.cuda.set_rng_state(cuda)
        get_cuda_rng_tracker().set_states(tracker)


def compile_ahead(ddp, workers, vocab_size: int, max_length: int, engine_pages: tuple[int, int] | None = None
                  ) -> dict | None:
    """Every rank runs the pass (its collectives meet); `workers` (this node's first rank's, else
    None) compile what it sends: the engine's kernels first when it runs in this process
    (`engine_pages`: its KV block size and longest request), then the trainer's. Returns
    the workers' outcome (compiling.workers.CompileWorkers.wait), None without workers, after
    every rank has waited for it."""
    sender = KernelSender(workers, driver.active.get_current_target())
    ddp.train()
    try:
        with _rng_kept(), autotune.picks_not_kept(), sending(flash_attention_4_cores(ddp), sender), ddp.no_sync():
            if engine_pages is not None:
                send_engine_kernels(ddp, sender, *engine_pages)
            for batch in dry_batches(vocab_size, max_length):
                logprobs, _ = forward_logprobs(ddp, batch.to(torch.cuda.current_device()))
                logprobs.sum().backward()
    finally:
        ddp.zero_grad_buffer()
    outcome = workers.wait() if workers is not None else None
    torch.distributed.barrier()
    return outcome


def compile_ahead_problem(model: torch.nn.Module) -> str | None:
    """Why the pass cannot run for `model` (its kernels then compile in its first step), or None."""
    if unwrap_model(model).config.num_moe_experts:
        return "a MoE router keeps state across forwards: routing replay, aux-loss sums"
    return None
