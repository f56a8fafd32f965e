"""Rollouts from megatron-core's DynamicInferenceEngine on the same GPTModel the trainer updates.

No weight conversion: the engine wraps the trainer's module, so an optimizer step is seen by the
next `generate()`. Chunked prefill stays off. Prefix caching (opt-in) lives for one
`conversation()` block only, whose turns all run under the same weights: no KV computed under
other weights is ever reused.

megatron-core's engine sets a process-wide `InferenceMode` flag at construction and never clears
it; while set, GPTModel asserts inference-style output gathering. `generate()` sets it only for
the duration of a generation, so the trainer's forward between generations runs normally.
"""

import contextlib
from dataclasses import dataclass

import torch
from megatron.core.inference.config import (
    InferenceConfig,
    KVCacheManagementMode,
    MambaInferenceStateConfig,
    PrefixCachingEvictionPolicy,
)
from megatron.core.inference.contexts.dynamic_context import DynamicInferenceContext
from megatron.core.inference.engines.dynamic_engine import DynamicInferenceEngine
from megatron.core.inference.inference_request import Status
from megatron.core.inference.model_inference_wrappers.gpt.gpt_inference_wrapper import (
    GPTInferenceWrapper,
)
from megatron.core.inference.sampling_params import SamplingParams
from megatron.core.inference.text_generation_controllers.text_generation_controller import (
    TextGenerationController,
)
from megatron.core.inference.utils import InferenceMode
from megatron.core.models.hybrid.hybrid_layer_allocation import Symbols
from megatron.core.utils import get_attr_wrapped_model

from megatron_rl_bi import bi, compat

compat.no_stack_dump_on_sigterm()  # at import: spawned helper processes import this module too


@dataclass(kw_only=True)
class EngineConfig:
    """Sizes of the dynamic engine's KV cache and step budget."""

    max_requests: int = 64
    """Requests decoded together in one step."""
    max_tokens: int = 8192
    """Tokens per engine step; must be at least the longest prompt (no chunked prefill)."""
    max_sequence_length: int = 2048
    """Prompt + generated tokens of one request."""
    buffer_size_gb: float = 4.0
    """KV cache size; too small a cache pauses and evicts requests (they still finish)."""
    block_size_tokens: int = 256
    """Tokens per KV block (FlashAttention page)."""
    prompt_logprobs: bool = False
    """Also report logprobs of prompt tokens 2..P (costs logits for every prompt token)."""
    processed_logprobs: bool = False
    """Report logprobs of the distribution sampled from (logits divided by the temperature)
    rather than of the raw logits: on whenever the temperature is not 1."""
    cuda_graphs: int | None = None
    """CUDA graphs of the decoder block the engine captures at construction, per batch size
    (megatron-core's num_cuda_graphs; -1: its own count); None: eager. The model must be built
    with --cuda-graph-impl local --inference-cuda-graph-scope block."""
    cuda_graphs_decode_only: bool = False
    """Graphs for decode-only steps alone (--decode-only-cuda-graphs)."""
    async_scheduling: bool = False
    """megatron-core's async scheduling (--inference-dynamic-batching-async-sched-mode async):
    a step's next forward is prepared before its requests are resolved, so host bookkeeping
    overlaps the GPU. Which tokens run together changes; with BI their bits do not."""
    prefix_caching: bool = False
    """megatron-core's prefix caching (--inference-dynamic-batching-prefix-caching), within a
    `Generator.conversation()` block: a turn's request reuses the KV blocks of its conversation
    that an earlier turn's prefill computed, instead of computing them again. Dense models only
    (the GDN layers keep no per-block states to resume from)."""
    kv_cache_management_mode: str = "persist"
    """megatron-core's KVCacheManagementMode between generations (--rl-kv-cache-management-mode):
    'persist' keeps the cache allocated; 'recompute' frees it (and GDN states) once the engine is
    built and when a generation ends, and allocates it again (capturing the CUDA graphs again)
    when the next one starts."""

    @property
    def max_prompt_tokens(self) -> int:
        """A prompt must fit one engine step (no chunked prefill) and leave room for a token."""
        return min(self.max_tokens, self.max_sequence_length - 1)


@dataclass(kw_only=True)
class Sampling:
    """How tokens are drawn. top_k=1 is greedy (the engine rejects temperature 0)."""

    max_new_tokens: int = 256
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 0.0
    eod_id: int | None = None
    """Stop a request when it samples this token (the token is kept, with its logprob)."""
    seed: int = 1234
    """Seeds the engine's sampling generator before each generate() call."""


@dataclass
class Generation:
    """One finished request. Logprobs are the engine's fp32 values (as Python floats)."""

    prompt_tokens: list[int]
    completion_tokens: list[int]
    completion_logprobs: list[float]  # [C]: the engine's logprob of each completion token
    prompt_logprobs: list[float] | None = None  # [P - 1] for tokens 2..P, None if not requested
    stopped_on_eod: bool = False
    max_new_tokens: int | None = None  # the budget the engine ran with (clamped to the context)
    completion_sampled: list[bool] | None = None
    """Per completion token of a conversation: sampled by the engine (True), or written by an
    environment between turns (False: context only, with no logprob, loss or parity); None:
    every completion token was sampled."""
    routing: torch.Tensor | None = None
    """[P + C - 1, MoE layers, k]: the experts each token the engine ran (all but the last) was
    routed to, under --moe-enable-routing-replay; None otherwise."""

    @property
    def tokens(self) -> list[int]:
        return self.prompt_tokens + self.completion_tokens

    @property
    def sampled_tokens(self) -> int:
        """Completion tokens the engine sampled: those the loss and the parity count."""
        return len(self.completion_tokens) if self.completion_sampled is None else sum(self.completion_sampled)


def gdn_inference_state_config(model: torch.nn.Module) -> MambaInferenceStateConfig | None:
    """Per-request state slots for a hybrid model's GDN layers, or None without GDN layers.

    megatron-core 0.19.2's dynamic context allocates recurrent-state slots only for layers marked
    Mamba ('M') and refuses 'G'; the GDN layers are declared as 'M' with GDN's state shapes
    (conv [D, kernel width] in the params dtype, recurrent [HV, K, V] in fp32). Hybrid models
    with real Mamba layers are not supported (one state shape serves all such layers).
    """
    decoder = get_attr_wrapped_model(model, "decoder")
    layer_types = list(getattr(decoder, "layer_type_list", []) or [])
    if Symbols.GDN not in layer_types:
        return None
    if Symbols.MAMBA in layer_types:
        raise ValueError("hybrid models with both GDN ('G') and Mamba ('M') layers")
    gdn = next(layer.self_attention for kind, layer in zip(layer_types, decoder.layers)
               if kind == Symbols.GDN)
    return MambaInferenceStateConfig(
        layer_type_list=[Symbols.MAMBA if kind == Symbols.GDN else kind for kind in layer_types],
        conv_states_shape=(gdn.conv_dim_local_tp, gdn.conv_kernel_dim),
        ssm_states_shape=(gdn.num_v_heads_local_tp, gdn.key_head_dim, gdn.value_head_dim),
        conv_states_dtype=model.config.params_dtype,
        ssm_states_dtype=torch.float32,
    )


PREFIX_CACHING_ON_HYBRID = ("--inference-dynamic-batching-prefix-caching: not with hybrid GDN models (their "
                            "layers keep no per-block states to resume a cached prefix from)")


def _check_prefix_caching(model: torch.nn.Module, config: EngineConfig) -> None:
    """Prefix caching is refused where it would change what is computed or cannot resume (the
    flags' check refuses the hybrid case before any GPU work with the same message)."""
    if not config.prefix_caching:
        return
    if gdn_inference_state_config(model) is not None:
        raise ValueError(PREFIX_CACHING_ON_HYBRID)
    if config.prompt_logprobs:
        raise ValueError("--inference-dynamic-batching-prefix-caching: a cached prefix gets no prompt logprobs")


class _TokenIdsOnly:
    """The engine detokenizes every finished request; rollouts here stay token ids."""

    def detokenize(self, tokens, skip_special_tokens=True):
        return ""


class Generator:
    def __init__(self, model: torch.nn.Module, config: EngineConfig):
        _check_prefix_caching(model, config)
        if model.config.batch_invariant_mode != bi.enabled():
            raise ValueError(
                f"model built with batch_invariant_mode={model.config.batch_invariant_mode} "
                f"but the BI switch is {'on' if bi.enabled() else 'off'}: build the model after "
                "setting the switch (--batch-invariant-mode)"
            )
        if config.cuda_graphs is not None and model.config.cuda_graph_impl != "local":
            raise ValueError("engine CUDA graphs need the model built with --cuda-graph-impl local "
                             "--inference-cuda-graph-scope block")
        self.model = model
        self.config = config
        self.in_conversation = self.fresh_conversation = False
        self.next_request_id = 0
        inference_config = InferenceConfig(
            block_size_tokens=config.block_size_tokens,
            buffer_size_gb=config.buffer_size_gb,
            max_requests=config.max_requests,
            max_tokens=config.max_tokens,
            max_sequence_length=config.max_sequence_length,
            materialize_only_last_token_logits=not config.prompt_logprobs,
            enable_prefix_caching=config.prefix_caching,
            # A turn's request comes after the last turn's finished: its blocks must stay cached
            # once released (megatron-core's default, ref_zero, drops them at once).
            prefix_caching_eviction_policy=PrefixCachingEvictionPolicy.LRU,
            enable_chunked_prefill=False,
            logprobs_mode="processed_logprobs" if config.processed_logprobs else "raw_logprobs",
            # The trainer reproduces the torch backend's processed logprobs (bi.sampling_logits).
            sampling_backend="torch",
            num_cuda_graphs=config.cuda_graphs,
            use_cuda_graphs_for_non_decode_steps=not config.cuda_graphs_decode_only,
            async_sched_mode="async" if config.async_scheduling else "legacy",
            mamba_inference_state_config=gdn_inference_state_config(model),
            kv_cache_management_mode=KVCacheManagementMode(config.kv_cache_management_mode),
        )
        context = DynamicInferenceContext(model.config, inference_config)
        controller = TextGenerationController(GPTInferenceWrapper(model, context), _TokenIdsOnly())
        compat.full_precision_graph_logits(controller)
        compat.single_bucket_sampling_without_sync()
        was_training = model.training
        model.eval()  # graphs are captured here, of the forward generate() runs
        try:
            self.engine = DynamicInferenceEngine(controller, context)
        finally:
            InferenceMode.unset_active()
            model.train(was_training)
        # Left as after a generation: the cache (sized for the generation phase) must not meet
        # the optimizer state that comes back to the GPU once the engine is built.
        self._release_cache()

    def check_prompt_lengths(self, lengths: list[int]) -> None:
        limit = self.config.max_prompt_tokens
        too_long = [i for i, n in enumerate(lengths) if n > limit]
        if too_long:
            raise ValueError(
                f"prompts {too_long[:5]} ({[lengths[i] for i in too_long[:5]]} tokens) are longer "
                f"than the engine allows ({limit}: --inference-dynamic-batching-max-tokens "
                f"{self.config.max_tokens}, --inference-max-seq-length "
                f"{self.config.max_sequence_length} less one generated token)"
            )

    @torch.no_grad()
    def generate(
        self,
        prompts: list[list[int]],
        sampling: Sampling,
        max_new_tokens: list[int] | None = None,
    ) -> list[Generation]:
        """Runs every prompt to completion; results in prompt order. `max_new_tokens` overrides
        `sampling.max_new_tokens` per prompt; each budget is clamped, as the engine would, to
        what the prompt leaves of `max_sequence_length`, and reported in the Generation."""
        if max_new_tokens is None:
            max_new_tokens = [sampling.max_new_tokens] * len(prompts)
        if len(max_new_tokens) != len(prompts):
            raise ValueError(f"{len(max_new_tokens)} max_new_tokens for {len(prompts)} prompts")
        if sampling.temperature != 1.0 and not self.config.processed_logprobs:
            raise ValueError(f"temperature {sampling.temperature}: the engine reports raw logprobs; "
                             "build it with EngineConfig(processed_logprobs=True)")
        self.check_prompt_lengths([len(p) for p in prompts])
        max_new_tokens = [min(n, self.config.max_sequence_length - len(p))
                          for n, p in zip(max_new_tokens, prompts)]
        params = [
            SamplingParams(
                temperature=sampling.temperature,
                top_k=sampling.top_k,
                top_p=sampling.top_p,
                num_tokens_to_generate=num_new,
                termination_id=-1 if sampling.eod_id is None else sampling.eod_id,
                return_log_probs=True,
                skip_prompt_log_probs=not self.config.prompt_logprobs,
            )
            for num_new in max_new_tokens
        ]
        was_training = self.model.training
        self.model.eval()
        InferenceMode.set_active()
        try:
            records = self._run(prompts, params, sampling.seed)
        finally:
            InferenceMode.unset_active()
            self.model.train(was_training)
        return [self._to_generation(record, prompt, sampling, budget)
                for record, prompt, budget in zip(records, prompts, max_new_tokens)]

    @contextlib.contextmanager
    def conversation(self):
        """The generations of one batch of conversations, every turn under the same weights:
        with prefix caching, a turn reuses the KV blocks its conversation's earlier turns
        prefilled (the cache starts empty with the block, and is freed after it as
        --rl-kv-cache-management-mode says). Without prefix caching nothing changes: each
        generation starts from an empty cache."""
        if not self.config.prefix_caching:
            yield
            return
        self.in_conversation = self.fresh_conversation = True
        try:
            yield
        finally:
            self.in_conversation = False
            self._release_cache()

    def _run(self, prompts: list[list[int]], params: list[SamplingParams], seed: int) -> list:
        """The engine's records of `prompts`: from an empty cache, or inside a conversation
        after its first turn on the cache as the last turn left it (ids keep counting)."""
        if not self.in_conversation or self.fresh_conversation:
            self.engine.resume()  # the cache back, where the last generation freed it
            self.engine.reset()
            self.next_request_id, self.fresh_conversation = 0, False
        self.engine.controller.sampling_rng.manual_seed(seed)
        device = torch.cuda.current_device()
        first, self.next_request_id = self.next_request_id, self.next_request_id + len(prompts)
        futures = [self.engine.add_request(first + i, torch.tensor(prompt, dtype=torch.int64, device=device),
                                           request_params)
                   for i, (prompt, request_params) in enumerate(zip(prompts, params))]
        while self.engine.has_unfinished_requests():
            self.engine.step_modern()
        records = [future.result().merge() for future in futures]
        if not self.in_conversation:
            self._release_cache()
        return records

    def _release_cache(self) -> None:
        if self.config.kv_cache_management_mode != "persist":
            self.engine.reset()  # no request left for resume() to add again
            self.engine.suspend()  # frees the cache while the trainer trains

    def _to_generation(self, request, prompt: list[int], sampling: Sampling, max_new_tokens: int) -> Generation:
        if request.status != Status.COMPLETED:
            raise RuntimeError(f"engine request {request.request_id} ended {request.status}")
        completion = list(request.generated_tokens)
        prompt_logprobs = list(request.prompt_log_probs) if self.config.prompt_logprobs else None
        return Generation(
            prompt_tokens=list(prompt),  # the caller's: reading the engine's GPU copy syncs
            completion_tokens=completion,
            completion_logprobs=list(request.generated_log_probs),
            prompt_logprobs=prompt_logprobs,
            stopped_on_eod=sampling.eod_id is not None and completion[-1:] == [sampling.eod_id],
            max_new_tokens=max_new_tokens,
            routing=None if request.routing_indices is None else torch.from_numpy(request.routing_indices),
        )
