"""Memory levers on CPU, fp32, with megatron-core's own layers: activation recompute (full and
selective) leaves logprobs, loss and every gradient `torch.equal` to the run without it, for a
dense and a hybrid GDN model; the chunked LM head gives the one-pass values; the flags that
cannot work are refused with their reason."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from megatron.training.argument_utils import core_transformer_config_from_args

from megatron_rl_bi import bi, compat
from megatron_rl_bi.config import parse_rl_args
from megatron_rl_bi.config.from_args import engine_config_from_args
from megatron_rl_bi.models import logprobs as head
from megatron_rl_bi.models.build import build_model
from megatron_rl_bi.models.logprobs import forward_logprobs
from megatron_rl_bi.numerics import relative_l2_error
from megatron_rl_bi.packing import pack_sequences

VOCAB = 40
COMMON = ["--hidden-size", "32", "--ffn-hidden-size", "48", "--num-attention-heads", "4",
          "--group-query-attention", "--num-query-groups", "2", "--swiglu", "--disable-bias-linear",
          "--seq-length", "64", "--max-position-embeddings", "64", "--use-cpu-initialization",
          "--no-initialization", "--transformer-impl", "local", "--flash-attention-version", "4"]
DENSE = ["--num-layers", "3"]
HYBRID = ["--hybrid-layer-pattern", "G-*-G-", "--linear-num-key-heads", "2", "--linear-num-value-heads", "4",
          "--linear-key-head-dim", "8", "--linear-value-head-dim", "8", "--linear-conv-kernel-dim", "4"]
SEQUENCES = [[1, 5, 9, 2, 7, 3, 30, 11], [4, 4, 8], [12, 13, 14, 15, 16, 17]]
RECOMPUTE = {
    "full, uniform": ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"],
    "full, block": ["--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers", "2"],
    "selective": ["--recompute-granularity", "selective"],
}


def _model(flags: list[str], weights: dict | None = None):
    args = parse_rl_args(COMMON + flags)
    with bi.batch_invariant(False):
        model = build_model(args, VOCAB)
    if weights is None:
        generator = torch.Generator().manual_seed(0)
        weights = {name: (torch.randn(p.shape, generator=generator) * 0.2 + (1.0 if p.dim() == 1 else 0.0))
                   for name, p in model.named_parameters()}
    model.load_state_dict(weights, strict=False)
    return model, weights


def _logprobs_and_gradients(model, with_entropy=True):
    """One packed forward of SEQUENCES, a loss over its logprobs (and entropy), the backward."""
    model.zero_grad()
    batch = pack_sequences(SEQUENCES)
    logprobs, entropy = forward_logprobs(model, batch, with_entropy=with_entropy)
    loss = -(logprobs * batch.has_target).sum() - 0.1 * (entropy * batch.has_target).sum()
    loss.backward()
    return logprobs.detach(), loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("layers", [DENSE, HYBRID], ids=["dense", "hybrid"])
@pytest.mark.parametrize("recompute", RECOMPUTE, ids=list(RECOMPUTE))
def test_recompute_leaves_logprobs_loss_and_gradients_equal(cpu_forward, layers, recompute):
    plain, weights = _model(layers)
    expected = _logprobs_and_gradients(plain)
    recomputing, _ = _model(layers + RECOMPUTE[recompute], weights)
    assert recomputing.config.recompute_granularity == RECOMPUTE[recompute][1]
    actual = _logprobs_and_gradients(recomputing)
    assert torch.equal(expected[0], actual[0]) and torch.equal(expected[1], actual[1])
    assert expected[2].keys() == actual[2].keys()
    for name in expected[2]:
        assert torch.equal(expected[2][name], actual[2][name]), name


def test_the_head_runs_in_chunks_and_gives_the_one_pass_values(cpu_forward, monkeypatch):
    """Rows of 5 (three chunks over 17 tokens) against one chunk. Not a bitwise claim on CPU: its
    GEMM may round a row differently with another row count (BI's kernels do not: GPU test
    tests/gpu/test_memory_levers.py); the values agree to fp32 rounding: logprobs elementwise,
    each gradient as a whole (relative L2 1e-6): a gradient element summed from terms that
    cancel can differ by more than its own size's rounding (torch 2.14.1's CPU GEMM: one of the
    tied embedding's 4,096, 2.8e-5 relative, the tensor 2.8e-7)."""
    model, _ = _model(DENSE)
    one_pass = _logprobs_and_gradients(model)
    calls = []
    original = head._head
    monkeypatch.setattr(head, "head_chunk_rows", lambda vocab: 5)
    monkeypatch.setattr(head, "_head", lambda *a, **k: calls.append(a[1].shape[0]) or original(*a, **k))
    chunked = _logprobs_and_gradients(model)
    assert calls[:3] == [5, 5, 5] and calls[3] == 2  # forward chunks (then their recomputation)
    assert len(calls) == 8  # each chunk recomputed once in the backward
    torch.testing.assert_close(chunked[0], one_pass[0], rtol=0, atol=1e-6)
    for name in one_pass[2]:
        assert relative_l2_error(chunked[2][name], one_pass[2][name]) <= 1e-6, name


class _VocabWideTensors(TorchDispatchMode):
    """Rows of every tensor an op allocates whose last dim is the vocabulary, in the forward and
    the backward."""

    def __init__(self, vocab: int):
        super().__init__()
        self.vocab, self.rows = vocab, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0]
                  if isinstance(t, torch.Tensor)}
        self.rows += [t.numel() // self.vocab for t in tree_flatten(out)[0]
                      if isinstance(t, torch.Tensor) and t.dim() > 1 and t.shape[-1] == self.vocab
                      and t.untyped_storage().data_ptr() not in inputs]  # views allocate nothing
        return out


def test_the_head_needs_no_logits_of_the_whole_batch(cpu_forward, monkeypatch):
    """The widest tensor the forward and backward create is a chunk of logits, never [T, V]."""
    model, _ = _model(DENSE)
    padded_vocab = model.output_layer.output_size
    batch = pack_sequences(SEQUENCES)
    for chunk_rows, widest in ((4, 4), (10**6, batch.input_ids.numel())):  # chunked, then one pass
        monkeypatch.setattr(head, "head_chunk_rows", lambda vocab: chunk_rows)
        with _VocabWideTensors(padded_vocab) as seen:
            logprobs, _ = forward_logprobs(model, batch)
            (-logprobs.sum()).backward()
        assert max(seen.rows) == widest


@pytest.mark.parametrize("flags, message", [
    (["--rl-kv-cache-management-mode", "offload"], "offload keeps the cache's contents on the CPU"),
    (["--rl-kv-cache-management-mode", "recompute", "--rl-persist-cuda-graphs"],
     "--rl-persist-cuda-graphs with --rl-kv-cache-management-mode recompute needs the cache at the same"),
    (["--rl-offload-optimizer-during-inference"], "needs --bf16 or --fp16"),
    (["--rl-kv-cache-memory-fraction", "0"], r"--rl-kv-cache-memory-fraction must be in \(0, 1\], got 0.0"),
    (["--rl-kv-cache-memory-fraction", "0.5", "--inference-dynamic-batching-buffer-size-gb", "8"],
     "both size the KV cache: give one"),
    (["--rl-offload-inference-model-weights-when-idle"],
     "--rl-offload-inference-model-weights-when-idle: not used by pretrain_rl.py"),
    (["--refit-method", "gloo"], "--refit-method: weights are sent only to generator ranks"),
    (["--inference-dynamic-batching-prefix-caching-mamba-gb", "1"],
     "--inference-dynamic-batching-prefix-caching-mamba-gb: not used by pretrain_rl.py"),
    (["--inference-dynamic-batching-prefix-caching-eviction-policy", "ref_zero"],
     "--inference-dynamic-batching-prefix-caching-eviction-policy: not used by pretrain_rl.py"),
    (["--rl-generator-ranks", "1", "--refit-method", "nvshmem"], "--refit-method nvshmem: gloo or nccl"),
])
def test_levers_that_cannot_work_are_refused(flags, message):
    with pytest.raises(ValueError, match=message):
        parse_rl_args(COMMON + DENSE + flags)


def test_prefix_caching_is_read_for_dense_models_and_refused_for_hybrid_ones():
    assert engine_config_from_args(parse_rl_args(COMMON + DENSE + ["--inference-dynamic-batching-prefix-caching"])
                                   ).prefix_caching
    assert not engine_config_from_args(parse_rl_args(COMMON + DENSE)).prefix_caching
    with pytest.raises(ValueError, match="--inference-dynamic-batching-prefix-caching: not with hybrid GDN models"):
        parse_rl_args(COMMON + HYBRID + ["--inference-dynamic-batching-prefix-caching"])


def test_levers_that_work_parse():
    args = parse_rl_args(COMMON + DENSE + ["--bf16", "--rl-offload-optimizer-during-inference",
                                           "--rl-kv-cache-management-mode", "recompute",
                                           "--rl-kv-cache-memory-fraction", "0.9", "--use-distributed-optimizer",
                                           *RECOMPUTE["full, uniform"]])
    assert args.rl_offload_optimizer_during_inference and args.rl_kv_cache_memory_fraction == 0.9


def test_full_recompute_with_the_engines_cuda_graphs():
    # megatron-core's config alone refuses full recompute with local graphs (a check for
    # training graphs; here the graphs are the engine's, which recomputes nothing)
    args = parse_rl_args(COMMON + DENSE + ["--bf16", "--cuda-graph-impl", "local", "--inference-cuda-graph-scope",
                                           "block", "--decode-only-cuda-graphs", *RECOMPUTE["full, uniform"]])
    with pytest.raises(AssertionError, match="full recompute is only supported with full iteration CUDA graph"):
        core_transformer_config_from_args(args)
    config = compat.transformer_config_with_engine_graphs(args)
    assert (config.cuda_graph_impl, config.recompute_granularity, config.recompute_method,
            config.recompute_num_layers) == ("local", "full", "uniform", 1)
