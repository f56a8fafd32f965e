"""The trainer's kernels compiled side by side before its first step (issue 48's first step).

A forward and backward of the policy on made-up packed batches in which nothing compiles or
launches: Triton's `jit_cache_hook` sends each new launch's specialization to the compile workers
(compiling/workers.py) and skips it, and each FlashAttention-4 call is sent with its shapes and
answered with an empty tensor. What the pass computes is garbage and goes nowhere: no gradient is
synchronized (DDP's no_sync), the gradient buffer is zeroed after, the RNG states are restored,
and autotuners keep no pick (bi.autotune.picks_not_kept). Once the workers are done, the run's
first step loads their kernels from Triton's and FlashAttention-4's disk caches.

BI mode only: there an autotuner tries its candidates in order, untimed (bi/autotune.py); in
default mode it would time launches that do not run.
"""

import contextlib
import json

import torch
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
from megatron.core.utils import unwrap_model
from triton import knobs
from triton.runtime import driver

from megatron_rl_bi.attention.flash import FlashCoreAttention
from megatron_rl_bi.bi import autotune
from megatron_rl_bi.models.logprobs import forward_logprobs
from megatron_rl_bi.packing import PackedBatch, pack_sequences

# The pass's batches: (sequences, the first one's length, the token count modulo 16). Triton
# compiles an integer argument apart when it is a multiple of 16 (a token count, a count of
# sequences or of chunks) and FlashAttention-4 a batch whose sequences fit one block apart: the
# four batches meet each class of each, in each pairing of the two counts.
DRY_SHAPES = ((5, 300, 5), (5, 300, 0), (16, 8, 5), (16, 8, 0))


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
        """A FlashAttention-4 varlen call sent (with its backward when it has one); an empty output."""
        def described(t):
            if t.dtype in (torch.int32, torch.int64):
                return {"values": t.tolist(), "dtype": str(t.dtype).removeprefix("torch.")}
            return {"shape": list(t.shape), "stride": list(t.stride()), "dtype": str(t.dtype).removeprefix("torch.")}
        self.send({"kind": "flash_attention", "name": f"flash_attn.cute varlen q{list(q.shape)} k{list(k.shape)}",
                   "tensors": {"q": described(q), "k": described(k), "v": described(v)},
                   "kwargs": {n: described(x) if torch.is_tensor(x) else x for n, x in kwargs.items()},
                   "backward": torch.is_grad_enabled() and q.requires_grad})
        return _SkippedAttention.apply(q, k, v)


class _SkippedAttention(torch.autograd.Function):
    """Attention that computes nothing, forward or backward: tensors of the right shapes."""

    @staticmethod
    def forward(ctx, q, k, v):
        ctx.save_for_backward(q, k, v)
        return q.new_empty(*q.shape[:-1], v.shape[-1])

    @staticmethod
    def backward(ctx, grad):
        return tuple(torch.empty_like(t) for t in ctx.saved_tensors)


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


def compile_ahead(ddp, workers, vocab_size: int, max_length: int) -> dict | None:
    """Every rank runs the pass (its collectives meet); `workers` (this node's first rank's, else
    None) compile what it sends. Returns the workers' outcome (compiling.workers.CompileWorkers.wait),
    None without workers, after every rank has waited for it."""
    sender = KernelSender(workers, driver.active.get_current_target())
    ddp.train()
    try:
        with _rng_kept(), autotune.picks_not_kept(), sending(flash_attention_4_cores(ddp), sender), ddp.no_sync():
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
