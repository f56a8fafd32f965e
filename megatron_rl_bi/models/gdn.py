"""megatron-core's GatedDeltaNet, made to serve both the trainer and the dynamic engine.

One varlen function (`_varlen_core`) runs the layer for the trainer (packed or batched sequences,
zero initial states) and for the engine (every active request a sequence, decode requests of
length 1, initial states from the request's slot), with fla's `causal_conv1d` in both. The rule's
forward kernel: BI mode, fla's recurrent kernel everywhere (`gdn_rule`); default mode, fla's
chunked kernel in the trainer and in engine steps with a prefill, the recurrent one in decode-only
steps.

megatron-core's own forward is not used: its helpers are `torch.compile`d (shape-dependent
recompiles every engine step, and code generated per shape where BI needs one fixed kernel per
op), and it calls the kernels without initial states. Parameters, initialization and checkpoint
layout stay megatron-core's. The engine keeps per-request conv and recurrent states in
megatron-core's Mamba state slots (`inference.engine.gdn_inference_state_config` declares GDN
layers to it); megatron-core 0.19.2's own GatedDeltaNet refuses any inference context.
"""

from functools import partial

import torch
import torch.nn.functional as F
from fla.modules.convolution import causal_conv1d
from megatron.core.inference.contexts.attention_context.triton.tensor_ops import (
    tensor_masked_update,
)
from megatron.core.ssm.gated_delta_net import GatedDeltaNet
from megatron.core.utils import deprecate_inference_params

from megatron_rl_bi import bi
from megatron_rl_bi.models.gdn_rule import gated_delta_rule
from megatron_rl_bi.packing import uniform_cu_seqlens


class SwitchedGatedDeltaNet(GatedDeltaNet):
    def _setup_variant_attrs(self):
        super()._setup_variant_attrs()
        if self.tp_size != 1 or self.cp_size != 1 or self.config.sequence_parallel:
            raise ValueError("SwitchedGatedDeltaNet supports TP = CP = 1 without sequence parallel")
        self.gated_delta_rule = partial(gated_delta_rule, chunk_backend="auto")

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None,
        inference_context=None,
        packed_seq_params=None,
        sequence_len_offset=None,
        *,
        inference_params=None,
        **kwargs,
    ):
        context = deprecate_inference_params(inference_context, inference_params)
        if context is not None:
            if not context.is_dynamic_batching():
                raise NotImplementedError("GDN layers run in megatron-core's dynamic engine only")
            return self._engine_forward(hidden_states, context)
        return self._trainer_forward(hidden_states, packed_seq_params)

    def _zero_states(self, num_sequences: int, like: torch.Tensor):
        conv = like.new_zeros(num_sequences, self.conv_dim_local_tp, self.conv_kernel_dim)
        rule = like.new_zeros(num_sequences, self.num_v_heads_local_tp, self.key_head_dim,
                              self.value_head_dim, dtype=torch.float32)
        return conv, rule

    def _trainer_forward(self, hidden_states, packed_seq_params):
        seq_len, batch, hidden = hidden_states.shape  # [s, b, h]; THD has b = 1
        if packed_seq_params is not None:
            cu_seqlens = packed_seq_params.cu_seqlens_q
            tokens = hidden_states[:, 0]
        else:
            cu_seqlens = uniform_cu_seqlens(batch, seq_len, hidden_states.device)
            tokens = hidden_states.transpose(0, 1).reshape(-1, hidden)
        conv_state, rule_state = self._zero_states(cu_seqlens.numel() - 1, hidden_states)
        out, bias, _, _ = self._varlen_core(tokens, cu_seqlens, conv_state, rule_state,
                                            recurrent=self._recurrent(decode_only=False))
        if packed_seq_params is None:
            return out.reshape(batch, seq_len, -1).transpose(0, 1), bias
        return out.unsqueeze(1), bias

    def _engine_forward(self, hidden_states, context):
        """Active tokens are [decode requests' tokens..., prefill requests' tokens..., padding]
        (eager steps pad decode requests only in decode-only steps; steps under a CUDA graph run
        `_graphed_decode_forward`)."""
        if context.num_speculative_tokens:
            raise NotImplementedError("GDN layers with speculative decoding")
        conv_state, rule_state = context.mamba_states_cache(self.layer_number)
        if context.using_cuda_graph_this_step():
            return self._graphed_decode_forward(hidden_states, context, conv_state, rule_state)
        metadata, dims = context.mamba_metadata, context.batch_dimensions
        num_decode, num_prefill = dims.decode_req_count, dims.prefill_req_count
        # decode requests are 1-token sequences; cu_seqlens_list is the prefills' own, from 0
        bounds = list(range(num_decode + 1)) + [
            num_decode + end for end in metadata.cu_seqlens_list[1 : num_prefill + 1]
        ]
        cu_seqlens = torch.tensor(bounds, dtype=torch.int32, device=hidden_states.device)
        # (either index tensor is None in a step without requests of its kind)
        slots = torch.cat([
            indices[:count].long()
            for indices, count in ((metadata.batch_indices_decode, num_decode),
                                   (metadata.batch_indices_prefill, num_prefill))
            if count
        ])
        real = bounds[-1]
        out, bias, conv_final, rule_final = self._varlen_core(
            hidden_states[:real, 0], cu_seqlens, conv_state[slots], rule_state[slots],
            recurrent=self._recurrent(decode_only=num_prefill == 0),
        )
        self._store_states(conv_state, rule_state, slots, conv_final, rule_final)
        padded = out.new_zeros(hidden_states.shape[0], 1, out.shape[-1])
        padded[:real, 0] = out
        return padded, bias

    def _graphed_decode_forward(self, hidden_states, context, conv_state, rule_state):
        """A decode-only step captured in, or replayed from, a CUDA graph: shapes from the padded
        batch, request slots read on the device (-1 marks a padding row), nothing from the host.
        Padding rows run on slot 0's states; their outputs are ignored and their states dropped."""
        if context.padded_batch_dimensions.prefill_req_count:
            raise NotImplementedError("GDN layers under CUDA graphs run decode-only steps only "
                                      "(--decode-only-cuda-graphs)")
        count = hidden_states.shape[0]
        slots = context.mamba_metadata.batch_indices_decode[:count]
        cu_seqlens = torch.arange(count + 1, dtype=torch.int32, device=hidden_states.device)
        # fla derives these from cu_seqlens on the host; every sequence is one token: chunk 0
        chunk_indices = torch.stack([cu_seqlens[:-1], torch.zeros_like(cu_seqlens[:-1])], dim=1)
        rows = slots.clamp(min=0).long()
        out, bias, conv_final, rule_final = self._varlen_core(
            hidden_states[:, 0], cu_seqlens, conv_state[rows], rule_state[rows],
            recurrent=self._recurrent(decode_only=True), chunk_indices=chunk_indices,
        )
        self._store_states(conv_state, rule_state, slots, conv_final, rule_final)
        return out.unsqueeze(1), bias

    @staticmethod
    def _store_states(conv_state, rule_state, slots, conv_final, rule_final):
        """Each request's final states into its slot of the engine's states (slot -1: dropped)."""
        tensor_masked_update(conv_state, slots, conv_final)
        tensor_masked_update(rule_state, slots, rule_final)

    def dry_state_stores(self, device) -> None:
        """The engine steps' state stores on made-up tensors, for compile ahead
        (models/compile_ahead.py, whose Triton hook sends the launches instead of running them):
        the trainer's forward never stores states. The final states come from `_varlen_core`, as
        in an engine step (their layouts are its outputs'), the states are laid out as one layer's
        of the engine's slots; the slots as an eager step makes them (a new int64 tensor) and as a
        graphed step reads them (a view into the engine's bookkeeping buffer, aligned to 8 bytes,
        so at 16 or not: Triton compiles a pointer's two alignments apart)."""
        like = torch.empty(0, dtype=self.config.params_dtype, device=device)
        conv_state, rule_state = self._zero_states(2, like)
        tokens = like.new_empty(9, self.config.hidden_size)
        cu_seqlens = torch.tensor([0, 1, 9], dtype=torch.int32, device=device)  # a decode, a prefill
        _, _, conv_final, rule_final = self._varlen_core(tokens, cu_seqlens, conv_state, rule_state,
                                                         recurrent=self._recurrent(decode_only=False))
        buffer = torch.zeros(3, dtype=torch.int64, device=device)
        for slots in (buffer[:2], buffer[1:]):
            self._store_states(conv_state, rule_state, slots, conv_final, rule_final)

    @staticmethod
    def _recurrent(decode_only: bool) -> bool:
        """The rule's forward kernel: recurrent in BI mode (one kernel for every call shape) and
        for decode-only engine steps; chunked otherwise."""
        return bi.enabled("gdn_recurrent") or decode_only

    def _varlen_core(self, tokens, cu_seqlens, conv_initial, rule_initial, recurrent: bool,
                     chunk_indices=None):
        """tokens [T, h] of N sequences (cu_seqlens [N + 1]), initial states [N, D, W] and
        [N, HV, K, V] -> (output [T, h], out_proj bias, final conv and rule states).
        `chunk_indices`: the conv's (sequence, chunk) pairs, else fla derives them."""
        num_tokens = tokens.shape[0]
        projected, _ = self.in_proj(tokens.unsqueeze(1))  # [T, 1, P]
        qkv, gate, beta, alpha = torch.split(projected.transpose(0, 1), self.feat_dim_split, dim=-1)
        qkv, conv_final = causal_conv1d(
            x=qkv, weight=self.conv1d.weight.squeeze(1),
            bias=self.conv1d.bias if self.conv_bias else None, activation=self.activation,
            initial_state=conv_initial, output_final_state=True, cu_seqlens=cu_seqlens,
            chunk_indices=chunk_indices,
        )
        query, key, value = self._heads(qkv, num_tokens)
        g = -self.A_log.exp() * F.softplus(alpha.float() + self.dt_bias)  # fp32, [1, T, HV]
        core, rule_final = self.gated_delta_rule(
            query, key, value, g, beta.sigmoid(), initial_state=rule_initial,
            output_final_state=True, use_qk_l2norm_in_kernel=self.use_qk_l2norm,
            cu_seqlens=cu_seqlens, forward="recurrent" if recurrent else "chunk",
        )
        out, bias = self.out_proj(self._gated_norm(core, gate).unsqueeze(1))
        return out[:, 0], bias, conv_final, rule_final

    def _heads(self, qkv, num_tokens):
        """[1, T, conv_dim] -> q, k, v [1, T, HV, K|V], q and k repeated to the value heads."""
        query, key, value = torch.split(
            qkv, [self.qk_dim_local_tp, self.qk_dim_local_tp, self.v_dim_local_tp], dim=-1
        )
        query = query.reshape(1, num_tokens, -1, self.key_head_dim)
        key = key.reshape(1, num_tokens, -1, self.key_head_dim)
        value = value.reshape(1, num_tokens, -1, self.value_head_dim)
        repeat = self.num_value_heads // self.num_key_heads
        if repeat > 1:
            query = query.repeat_interleave(repeat, dim=2)
            key = key.repeat_interleave(repeat, dim=2)
        return query.contiguous(), key.contiguous(), value.contiguous()

    def _gated_norm(self, core, gate):
        """Per value head: RMSNorm(core) * act(gate), as megatron-core's output gate: [T, v_dim]."""
        rows = core.reshape(-1, self.value_head_dim)
        gated = self.out_norm(rows) * self.act_fn(gate.reshape(-1, self.value_head_dim).float())
        return gated.to(core.dtype).reshape(core.shape[1], -1)
