"""Memory levers on the GPU, BI mode: the trainer's chunked LM head gives the one-pass logprobs
bit for bit; an engine that frees its KV cache between generations (--rl-kv-cache-management-
mode recompute), eager and graphed, generates what a persistent one does, frees the memory, and
keeps trainer parity; activation recompute keeps trainer parity; the optimizer's state parked
while generating comes back bit for bit, and with the optimizer on the CPU its step still reaches
the model's weights."""

import gc

import pytest
import torch
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

from megatron_rl_bi import bi
from megatron_rl_bi.inference import EngineConfig, Generator, Sampling
from megatron_rl_bi.models import logprobs as head
from megatron_rl_bi.models.logprobs import forward_logprobs
from megatron_rl_bi.packing import pack_sequences
from megatron_rl_bi.parity.harness import random_requests, run_parity
from megatron_rl_bi.rl.optimizer_offload import generating, optimizer_tensors

from .conftest import TINY_DENSE_ARGS, TINY_HYBRID_ARGS, VOCAB_SIZE, build, build_dense, packed_logits

pytestmark = pytest.mark.gpu

GRAPH_FLAGS = ["--cuda-graph-impl", "local", "--inference-cuda-graph-scope", "block"]
RECOMPUTE = ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]


@pytest.fixture
def bi_dense(distributed):
    try:
        yield build_dense(batch_invariant=True)
    finally:
        bi.disable()


def test_the_chunked_head_gives_the_one_pass_logprobs(bi_dense, monkeypatch):
    generator = torch.Generator().manual_seed(0)
    sequences = [torch.randint(0, VOCAB_SIZE, (n,), generator=generator).tolist() for n in (700, 33, 1200)]
    batch = pack_sequences(sequences).to("cuda")
    one_pass, _ = forward_logprobs(bi_dense, batch, with_entropy=False)
    for rows in (1, 97, 512):
        monkeypatch.setattr(head, "head_chunk_rows", lambda vocab, rows=rows: rows)
        chunked, _ = forward_logprobs(bi_dense, batch, with_entropy=False)
        assert torch.equal(chunked, one_pass), rows


def _engine(mode: str, graphs: bool, decode_only: bool) -> EngineConfig:
    return EngineConfig(max_requests=32, max_tokens=8192, max_sequence_length=1024, buffer_size_gb=2.0,
                        cuda_graphs=-1 if graphs else None, cuda_graphs_decode_only=decode_only,
                        kv_cache_management_mode=mode)


MODELS = {"dense": (TINY_DENSE_ARGS, []), "hybrid": (TINY_HYBRID_ARGS, ["--decode-only-cuda-graphs"])}


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_an_engine_that_frees_its_cache_generates_the_same(distributed, name, graphs):
    model_args, extra = MODELS[name]
    model_parallel_cuda_manual_seed(1234, use_cudagraphable_rng=graphs, force_reset_rng=True)
    try:
        model = build(model_args, batch_invariant=True, extra=(GRAPH_FLAGS + extra) if graphs else [])
        decode_only = bool(extra)
        prompts, budgets = random_requests(24, (1, 300), (1, 64), VOCAB_SIZE, seed=7)
        sampling = Sampling(temperature=1.0, seed=7)
        # eager: the model's graphs belong to one engine's context (graphed == eager: test_cuda_graphs)
        persist = Generator(model, _engine("persist", False, decode_only))
        expected = persist.generate(prompts, sampling, budgets)
        del persist
        gc.collect()  # the engine's reference cycles keep its cache allocated until collected
        without_cache = torch.cuda.memory_allocated()
        freeing = Generator(model, _engine("recompute", graphs, decode_only))
        assert torch.cuda.memory_allocated() < without_cache + 2**30  # built, its 2 GB cache freed
        for _ in range(2):  # the cache is made again for each generation, and freed after it
            torch.cuda.reset_peak_memory_stats()
            got = freeing.generate(prompts, sampling, budgets)
            assert torch.cuda.max_memory_allocated() >= without_cache + 1.9 * 2**30
            assert torch.cuda.memory_allocated() < without_cache + 2**30
            assert [g.completion_tokens for g in got] == [g.completion_tokens for g in expected]
            assert [g.completion_logprobs for g in got] == [g.completion_logprobs for g in expected]
        result = run_parity(model, freeing, prompts, budgets, sampling, micro_batch_tokens=6000, orders=1)
        assert result["all_reported"]["bit_wise/logprob_diff/max"] == 0.0
    finally:
        bi.disable()
        model_parallel_cuda_manual_seed(1234, force_reset_rng=True)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_recompute_keeps_trainer_parity(distributed, name):
    model_args, _ = MODELS[name]
    try:
        model = build(model_args, batch_invariant=True, extra=RECOMPUTE)
        assert model.config.recompute_granularity == "full"
        generator = Generator(model, _engine("persist", False, False))
        prompts, budgets = random_requests(16, (1, 300), (1, 64), VOCAB_SIZE, seed=3)
        model.train()
        result = run_parity(model, generator, prompts, budgets, Sampling(seed=3), micro_batch_tokens=6000,
                            orders=1)
        assert result["all_reported"]["bit_wise/logprob_diff/max"] == 0.0
    finally:
        bi.disable()


class _Optimizer:
    def __init__(self, optimizer):
        self.optimizer = optimizer


def test_the_optimizer_waits_in_page_locked_buffers_and_comes_back_bit_for_bit():
    params = [torch.nn.Parameter(torch.randn(1 << 22, device="cuda")) for _ in range(3)]
    adam = torch.optim.Adam(params)
    for param in params:
        param.grad = torch.randn_like(param)
    adam.step()
    for param in params:
        param.grad = None
    optimizer = _Optimizer(adam)

    expected = [t.clone() for t in optimizer_tensors(optimizer)]
    # Adam's step counts are CPU tensors: they stay
    on_gpu = sum(t.numel() * t.element_size() for t in optimizer_tensors(optimizer) if t.is_cuda)
    with_state = torch.cuda.memory_allocated()
    buffers = []
    for _ in range(2):
        with generating(optimizer, True):
            assert torch.cuda.memory_allocated() == with_state - on_gpu
            assert all(t.is_pinned() or t.dim() == 0 for t in optimizer_tensors(optimizer))
            buffers.append([t.data_ptr() for t in optimizer_tensors(optimizer)])
        assert all(torch.equal(a, b) for a, b in zip(optimizer_tensors(optimizer), expected))
        assert [t.device for t in optimizer_tensors(optimizer)] == [t.device for t in expected]
    assert buffers[0] == buffers[1]  # the host buffers are kept for the run


def test_the_optimizer_on_the_cpu_still_updates_the_weights_after_a_park(distributed):
    """--optimizer-cpu-offload with --rl-offload-optimizer-during-inference, as the Qwen3.5
    recipe runs one GPU: after the engine's phase the optimizer's step reaches the model's own
    weights, which still live in DDP's buffer. Parking the optimizer's shards of that buffer once
    made them tensors of their own, and every update went into those."""
    from megatron_rl_bi.config import parse_args
    from megatron_rl_bi.optimizer import build_ddp_and_optimizer

    flags = ["--batch-invariant-mode", "--optimizer-cpu-offload", "--use-precision-aware-optimizer",
             "--use-distributed-optimizer", "--lr", "1e-2"]
    try:
        model = build_dense(batch_invariant=True, extra=flags[1:])
        ddp, optimizer = build_ddp_and_optimizer(parse_args(TINY_DENSE_ARGS + flags), model)
        addresses = [p.data_ptr() for p in model.parameters()]
        with generating(optimizer, True):  # the engine's build and a generation
            pass
        before = [p.detach().clone() for p in model.parameters()]
        ddp.zero_grad_buffer()
        packed_logits(ddp, [list(range(1, 200))]).float().logsumexp(-1).mean().backward()
        ddp.finish_grad_sync()
        params = list(model.parameters())
        with_gradient = [bool(p.main_grad.any()) for p in params]
        optimizer.step()
        assert [p.data_ptr() for p in params] == addresses
        moved = [not torch.equal(b, p) for b, p, g in zip(before, params, with_gradient) if g]
        assert moved and all(moved)
    finally:
        bi.disable()
