"""Workarounds for upstream behaviour, each citing what it works around and when it can go.

Every patch of a library lives here and nowhere else.
"""

import argparse
import contextlib
import functools
import importlib.util
import re
import sys

import torch

from megatron.core.transformer.custom_layers import batch_invariant_kernels as _mcore_bik
from megatron.training.argument_utils import core_transformer_config_from_args


def transformer_engine_installed() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None


def apex_gradient_accumulation_fusion_installed() -> bool:
    """megatron-core 0.19.2 defaults to gradient-accumulation fusion, whose linear layers (TE's
    and local) need APEX's `fused_weight_gradient_mlp_cuda` extension and fail at model build
    without it; the default is turned off where the extension is missing."""
    return importlib.util.find_spec("fused_weight_gradient_mlp_cuda") is not None


@contextlib.contextmanager
def transformer_engine_optional():
    """Lets megatron-core's `enable_batch_invariant_mode()` run without TransformerEngine.

    megatron-core 0.19.2 `enable_batch_invariant_mode()` registers the aten overrides, sets its
    mode flag and only then calls `_te_patch_for_batch_invariant()`, which imports
    transformer_engine unconditionally: without TE it raises ModuleNotFoundError and leaves the
    mode half-enabled. Without TE there is nothing to patch, so the TE step is skipped for the
    duration of the call. Remove once upstream treats TE as optional there
    (tests/unit_tests/test_bi_switch.py::test_upstream_enable_without_te_half_enables pins it).
    """
    if transformer_engine_installed():
        yield
        return
    original = _mcore_bik._te_patch_for_batch_invariant
    _mcore_bik._te_patch_for_batch_invariant = lambda: None
    try:
        yield
    finally:
        _mcore_bik._te_patch_for_batch_invariant = original


def escape_help_percent_signs(parser: argparse.ArgumentParser) -> None:
    """megatron-core 0.19.2 builds some flags' help from config docstrings that contain a bare
    '%' (e.g. --moe-paged-stash-buffer-size-factor-cuda), which argparse reads as a format
    directive: `--help` raises ValueError. Bare '%' become '%%'; argparse's own `%(default)s`
    placeholders stay. Remove once upstream escapes them
    (tests/unit_tests/test_help.py::test_upstream_help_still_breaks pins it)."""
    for action in parser._actions:
        if isinstance(action.help, str) and "%" in action.help:
            action.help = re.sub(r"%%|%\(\w+\)[a-z]|%",
                                 lambda m: m.group(0) if len(m.group(0)) > 1 else "%%", action.help)


@contextlib.contextmanager
def megatron_arguments_dump_deferred():
    """megatron-core 0.19.2's `validate_args` prints every argument (~900 lines) as its last act,
    before this package's checks of recipes, datasets and checkpoints: an input error then came
    after the dump, off the user's screen. The dump is held back while parsing;
    `print_megatron_arguments` prints it once a run's inputs are read. Remove once upstream
    separates validating from printing."""
    from megatron.training import arguments

    original = arguments._print_args
    arguments._print_args = lambda title, args: None
    try:
        yield
    finally:
        arguments._print_args = original


def print_megatron_arguments(args: argparse.Namespace) -> None:
    """megatron-core's argument dump (rank 0), which `megatron_arguments_dump_deferred` held back."""
    from megatron.training import arguments

    arguments._print_args("arguments", args)


def no_stack_dump_on_sigterm() -> None:
    """megatron-core 0.19.2's data-parallel inference coordinator module registers faulthandler
    for SIGTERM and SIGINT when imported (coordinator.py), which importing the dynamic engine
    does: every such process, and every helper process that imports the entry point again
    (dist checkpointing's spawned writer queue), printed `Stack (most recent call first):
    <no Python frame>` when terminated, even at a clean exit. This package runs no coordinator;
    the two registrations are undone (faulthandler's dump on a crash stays). Remove once upstream
    registers them in the coordinator's process only
    (tests/unit_tests/test_clean_exit.py::test_upstream_still_registers pins it)."""
    import faulthandler
    import signal

    from megatron.core.inference.data_parallel_inference_coordinator import coordinator  # noqa: F401

    for signal_number in (signal.SIGTERM, signal.SIGINT):
        faulthandler.unregister(signal_number)


RECOMPUTE_FIELDS = ("recompute_granularity", "recompute_method", "recompute_num_layers")


def transformer_config_with_engine_graphs(args: argparse.Namespace):
    """megatron-core 0.19.2's TransformerConfig from `args`. Its __post_init__ refuses full
    recompute with --cuda-graph-impl local: that check guards training CUDA graphs, while here
    the local graphs are the engine's alone (the trainer runs eagerly: --rl-training-cuda-graphs
    is refused) and the engine runs in eval mode, where TransformerBlock recomputes nothing. So
    the recompute flags are checked on a config without graphs, and the config with graphs
    receives them after its own check. Remove once megatron-core limits the check to training
    graphs."""
    if args.cuda_graph_impl != "local" or args.recompute_granularity != "full":
        return core_transformer_config_from_args(args)
    checked = core_transformer_config_from_args(
        argparse.Namespace(**{**vars(args), "cuda_graph_impl": "none", "inference_cuda_graph_scope": "none"}))
    config = core_transformer_config_from_args(argparse.Namespace(**{**vars(args), "recompute_granularity": None}))
    for name in RECOMPUTE_FIELDS:
        setattr(config, name, getattr(checked, name))
    return config


@contextlib.contextmanager
def final_hidden_states(language_model):
    """megatron-core 0.19.2's GPTModel and HybridModel run their LM head inside forward, over the
    whole batch (GPTModel has an `output_processor` hook, HybridModel none). With `post_process`
    off, both return the decoder's output instead (its final norm applied: the norm belongs to
    the decoder), as a pipeline stage without the output layer does; models.logprobs runs the
    head itself, in chunks. Remove once both models take an output hook."""
    saved = language_model.post_process
    language_model.post_process = False
    try:
        yield
    finally:
        language_model.post_process = saved


def bm25s_without_jax():
    """bm25s imported with JAX hidden. bm25s 0.2-0.3's selection module runs a JAX op at import
    when JAX is installed, and JAX's first op takes 75 % of the GPU's memory for its own pool
    (seen on the H200: 105 GiB gone before the trainer built its optimizer). Without JAX bm25s
    uses its numpy top-k, which is what a corpus this size needs. Remove when bm25s imports JAX
    lazily."""
    if "bm25s" in sys.modules:
        return sys.modules["bm25s"]
    saved = {name: sys.modules.pop(name) for name in list(sys.modules) if name.split(".")[0] == "jax"}
    sys.modules["jax"] = None  # makes `import jax...` raise ImportError
    try:
        import bm25s
    finally:
        del sys.modules["jax"]
        sys.modules.update(saved)
    return bm25s


@functools.cache  # asked by every GDN layer's forward and backward; the answer is the process's
def fla_chunk_backward_works() -> bool:
    """fla 0.6.0 refuses its chunked gated-delta-rule backward on Hopper (sm90) with Triton >= 3.4
    and < 3.7.1 (a Triton miscompile of one of its steps, which it guards against). Where it
    refuses, that step is replaced (`replace_fla_gated_dqkwg`). Remove when the supported Triton
    is >= 3.7.1.
    """
    from packaging.version import Version

    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        return True
    import triton

    triton_version = Version(triton.__version__.split("+")[0])
    return not Version("3.4") <= triton_version < Version("3.7.1")


def replace_fla_gated_dqkwg(replacement) -> None:
    """Where fla 0.6.0 refuses its chunked gated-delta-rule backward (`fla_chunk_backward_works`),
    only its gated `chunk_bwd_dqkwg` is wrong there; the gated delta rule's backward calls
    `replacement` in its place (same signature), so the rest of fla's backward runs. For this
    process, for every caller of fla's gated delta rule: there that function raised."""
    import fla.ops.gated_delta_rule.chunk as gated_delta_rule_chunk

    gated_delta_rule_chunk.chunk_bwd_dqkwg = replacement


@contextlib.contextmanager
def fla_hopper_backward_guard_lifted():
    """fla 0.6.0's gated chunk_bwd_dqkwg raises on Hopper with Triton >= 3.4 and < 3.7.1: there
    Triton miscompiles a transposed operand left in the wgmma accumulator layout (fla issue 640,
    reported at BK = 64; fla 0.6.0 tiles heads of K = 128 with BK = 128 on Hopper). Lifted only to
    measure the refused kernel (bench/gdn_rule.py: its time, and its gradients against the torch
    rule's), so fla's own step is back in the gated delta rule's backward meanwhile, in place of
    any `replace_fla_gated_dqkwg` replacement; no training path lifts it."""
    import fla.ops.common.chunk_o as chunk_o
    import fla.ops.gated_delta_rule.chunk as gated_delta_rule_chunk

    saved = chunk_o.TRITON_ABOVE_3_7_1, gated_delta_rule_chunk.chunk_bwd_dqkwg
    chunk_o.TRITON_ABOVE_3_7_1, gated_delta_rule_chunk.chunk_bwd_dqkwg = True, chunk_o.chunk_bwd_dqkwg
    try:
        yield
    finally:
        chunk_o.TRITON_ABOVE_3_7_1, gated_delta_rule_chunk.chunk_bwd_dqkwg = saved


@contextlib.contextmanager
def hybrid_stack_final_norm(norm_class):
    """megatron-core 0.19.2's HybridStack builds its final norm as `TENorm` unconditionally
    (models/hybrid/hybrid_block.py, "Hybrid always uses TransformerEngine"). For the non-TE
    hybrid spec, the stack is built with `norm_class` in its place (None: TENorm stays). Remove
    once HybridStack takes its final norm from the spec.
    """
    from megatron.core.models.hybrid import hybrid_block

    if norm_class is None:
        yield
        return
    original = hybrid_block.TENorm
    hybrid_block.TENorm = norm_class
    try:
        yield
    finally:
        hybrid_block.TENorm = original


def full_precision_graph_logits(controller) -> None:
    """megatron-core 0.19.2's TextGenerationController, for a model with cuda_graph_impl local,
    copies each step's logits into a buffer of the params dtype (bf16) and samples from it (the
    torch backend then divides by the temperature and takes the softmax in bf16), where the
    eager path samples from the fp32 logits Float16Module returns. The buffer is replaced by an
    fp32 one of the same shape, so a step samples the same tokens with graphs as without. Remove
    once upstream sizes the buffer in the logits' dtype."""
    buffer = controller._all_logits_cuda
    if buffer is not None and buffer.dtype != torch.float32:
        controller._all_logits_cuda = torch.zeros_like(buffer, dtype=torch.float32)


def one_call_packed_rope() -> None:
    """megatron-core 0.19.2 applies unfused rope to packed (THD) sequences one sequence at a
    time (`rope_utils._apply_rotary_pos_emb_thd`: two host syncs, then ~10 small kernels per
    sequence, per layer, for q and k, forward and backward). Without context parallelism this
    gathers each token's frequencies by its position in its sequence and makes the same
    elementwise calls once for the whole batch: the same operations on the same values, so the
    same bits (tests/unit_tests/test_packed_rope.py). Idempotent. Remove once upstream applies
    THD rope in one call."""
    from megatron.core.models.common.embeddings import rope_utils

    if getattr(rope_utils._apply_rotary_pos_emb_thd, "one_call", False):
        return
    upstream = rope_utils._apply_rotary_pos_emb_thd

    def packed_rope(t, cu_seqlens, freqs, rotary_interleaved=False, mla_rotary_interleaved=False,
                    mscale=1.0, cp_group=None, multi_latent_attention=None):
        total = t.shape[0]
        if (cp_group is None or cp_group.size() != 1 or freqs.size(0) == total
                or multi_latent_attention is not None):
            return upstream(t, cu_seqlens, freqs, rotary_interleaved, mla_rotary_interleaved,
                            mscale, cp_group, multi_latent_attention)
        lengths = cu_seqlens[1:] - cu_seqlens[:-1]
        starts = torch.repeat_interleave(cu_seqlens[:-1].long(), lengths, output_size=total)
        positions = torch.arange(total, device=t.device) - starts
        return rope_utils._apply_rotary_pos_emb_bshd(
            t.unsqueeze(1), freqs[positions], rotary_interleaved=rotary_interleaved,
            mla_rotary_interleaved=mla_rotary_interleaved, mscale=mscale,
        ).squeeze(1)

    packed_rope.one_call = True
    rope_utils._apply_rotary_pos_emb_thd = packed_rope


def fa4_hopper_without_split_kv() -> None:
    """megatron-core 0.19.2's engine calls flash-attn-4 with `num_splits=0` (FA4's split-KV
    heuristic) in default mode. flash-attn-4 4.0.0b36 has no split-KV kernel for SM90, yet its
    heuristic picks one for decode steps over a long `max_seqlen_k` (CUDA-graph steps are sized
    for the longest sequence) and then fails an assertion. On SM90 the request becomes
    `num_splits=1`, the only kernel there; BI mode asks for 1 already. Idempotent. Remove once
    flash-attn-4's heuristic knows the architecture."""
    from megatron.core.transformer import attention

    upstream = getattr(attention, "flash_attn4_varlen_func", None)
    if upstream is None or getattr(upstream, "without_hopper_split_kv", False):
        return

    def varlen(q, *args, **kwargs):
        if kwargs.get("num_splits", 1) < 1 and torch.cuda.get_device_capability(q.device)[0] == 9:
            kwargs["num_splits"] = 1
        return upstream(q, *args, **kwargs)

    varlen.without_hopper_split_kv = True
    attention.flash_attn4_varlen_func = varlen


def _single_bucket(context, rows: int):
    """The one (temperature, top-k, top-p) of all `rows` active requests, or None when they
    differ or the rows are not the active requests."""
    active = context.total_request_count - context.paused_request_count
    metadata = context.active_request_metadata
    buckets = set(zip(*(metadata[key][:active].tolist() for key in ("temperature", "top_k", "top_p"))))
    return next(iter(buckets)) if len(buckets) == 1 and rows == active else None


def _sample_rows(rows, temperature, top_k, top_p, generator, vocab_size):
    """megatron-core's `TorchSampling.sample_from_logits` with torch.multinomial's one-sample path
    written out: an Exp(1) draw of the probabilities' shape from the same generator, the
    probabilities over it, argmax; so the same tokens, without the ~9 kernels multinomial launches
    each call to assert, on the GPU, finite non-negative probabilities of non-zero sum (the
    softmax of filtered logits is that, unless the logits hold NaN)."""
    from megatron.core.inference.sampling.torch_sampling import TorchSampling

    if top_k == 1:
        return torch.argmax(rows, dim=-1)
    filtered = TorchSampling.filter_logits(rows, temperature, top_k, top_p, vocab_size=vocab_size)
    probabilities = filtered.softmax(dim=-1)
    race = torch.empty_like(probabilities).exponential_(1, generator=generator)
    sampled = torch.argmax(probabilities / race, dim=-1)
    return sampled.clamp(min=0, max=vocab_size - 1) if vocab_size else sampled


def single_bucket_sampling_without_sync() -> None:
    """megatron-core 0.19.2's torch sampler builds each (temperature, top-k, top-p) bucket's rows
    with `torch.tensor(list, device=cuda)`, a blocking copy, in `sample_kernel` and again in
    `log_probs_kernel` (processed logprobs, temperature != 1): at every decode step the host waits
    there for the forward that made the logits, which also undoes async scheduling's overlap of
    host bookkeeping with the next forward. When every active request is in one bucket (a
    `Generator.generate` call has one Sampling) the rows are 0..n-1: they are sampled from
    `logits[:n]` (or the gathered rows) directly, the same values and the same generator draw, so
    the same tokens (`_sample_rows`), and their log-probs are the log-softmax of the same filtered
    rows, without the wait. Other cases go to megatron-core's. Idempotent. Remove once upstream builds the
    indices without a sync."""
    from megatron.core.inference.sampling.torch_sampling import TorchSampling

    upstream_sample, upstream_log_probs = TorchSampling.sample_kernel, TorchSampling.log_probs_kernel
    if hasattr(upstream_sample, "upstream"):
        return

    def sample_kernel(self, logits, n, context, *, gather_indices=None, token_to_request_index=None,
                      output=None, **kwargs):
        bucket = _single_bucket(context, n)
        if bucket is None or token_to_request_index is not None:
            return upstream_sample(self, logits, n, context, gather_indices=gather_indices,
                                   token_to_request_index=token_to_request_index, output=output, **kwargs)
        temperature, top_k, top_p = bucket
        rows = logits[gather_indices[:n], :] if gather_indices is not None else logits[:n]
        tokens = _sample_rows(rows, temperature, top_k, top_p, self._rng, self._vocab_size)
        if output is None:
            return tokens
        return output.copy_(tokens)

    def log_probs_kernel(self, logits, context, *, token_to_request_index=None):
        bucket = _single_bucket(context, logits.shape[0])
        if bucket is None or token_to_request_index is not None:
            return upstream_log_probs(self, logits, context, token_to_request_index=token_to_request_index)
        temperature, top_k, top_p = bucket
        filtered = TorchSampling.filter_logits(logits, float(temperature), int(top_k), float(top_p),
                                               vocab_size=self._vocab_size)
        return torch.log_softmax(filtered, dim=-1)

    # megatron-core's kernels, for the GPU tests that compare them
    sample_kernel.upstream, log_probs_kernel.upstream = upstream_sample, upstream_log_probs
    TorchSampling.sample_kernel, TorchSampling.log_probs_kernel = sample_kernel, log_probs_kernel
