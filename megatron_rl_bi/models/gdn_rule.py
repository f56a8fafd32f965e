"""The gated delta rule with a forward kernel chosen by the caller and a chunked backward.

BI mode runs fla's recurrent kernel forward (`fused_recurrent_gated_delta_rule`) in trainer and
engine: one program per (sequence, head, value block), no autotuning, the same binary for a
prefill of any length and for one-token decode, so a sequence's bits do not depend on the rest of
the batch or on how its tokens are split into calls. That kernel has no backward; the autograd
Function here recomputes the output with a *chunked* formulation of the same recurrence (the same
function, evaluated in another order) and differentiates that. No parity claim is made on
gradients.

Default mode runs fla's chunked kernel forward; its own backward is used where fla allows it.

Kernel-call contract shared with the engine: `initial_state` is always passed (zeros for a fresh
sequence). fla compiles a different variant without it, whose bits differ (measured on the H200).

Chunked backends: 'torch' (megatron-core's `torch_chunk_gated_delta_rule`, fp32, runs anywhere;
packed sequences are zero-padded into one batch, which leaves outputs and final states unchanged:
a zero key with zero beta and zero log-decay does not touch the state), 'fla' (fla's
`chunk_gated_delta_rule` and its Triton backward, varlen-native; where fla 0.6.0 refuses that
backward (Hopper with Triton >= 3.4 and < 3.7.1, `compat.fla_chunk_backward_works`) its one
miscompiled step runs as this package's Triton kernel, models/gdn_dqkwg_triton.py), and 'auto'
(what layers train with): fla's on GPU tensors, torch's on CPU ones (fla's chunked kernels have no
CPU path).
"""

import functools

import torch
import torch.nn.functional as F
from torch.nn.utils.rnn import pad_sequence

from megatron_rl_bi import compat
from megatron_rl_bi.models.gdn_dqkwg_triton import chunk_bwd_dqkwg
from megatron_rl_bi.packing import sequence_lengths

FORWARD_KERNELS = ("recurrent", "chunk")
CHUNK_BACKENDS = ("torch", "fla", "auto")


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return F.normalize(x.float(), dim=-1, eps=1e-6).to(x.dtype)


def _torch_chunked(q, k, v, g, beta, initial_state, scale, cu_seqlens):
    """megatron-core's torch chunked rule (no varlen support there); q, k already normalized."""
    from megatron.core.ssm.gated_delta_net import torch_chunk_gated_delta_rule

    q = q * (scale * q.shape[-1] ** 0.5)  # that function scales q by K ** -0.5 itself
    if cu_seqlens is None:
        return torch_chunk_gated_delta_rule(
            q, k, v, g=g, beta=beta, initial_state=initial_state, output_final_state=True
        )
    lengths = sequence_lengths(cu_seqlens)
    q, k, v, g, beta = (pad_sequence(t[0].split(lengths), batch_first=True) for t in (q, k, v, g, beta))
    out, state = torch_chunk_gated_delta_rule(
        q, k, v, g=g, beta=beta, initial_state=initial_state, output_final_state=True
    )
    return torch.cat([out[i, :n] for i, n in enumerate(lengths)]).unsqueeze(0), state


@functools.cache
def _fla_chunk_backward_here() -> None:
    """Where fla refuses its chunked backward, its miscompiled step is replaced by this package's
    kernel of it (once a process; fla then runs the rest of its backward as it does elsewhere)."""
    if not compat.fla_chunk_backward_works():
        compat.replace_fla_gated_dqkwg(chunk_bwd_dqkwg)


def _fla(kernel, q, k, v, g, beta, initial_state, scale, cu_seqlens, use_l2=False):
    """fla's 'recurrent' (fused_recurrent) or 'chunk' rule, called the one way both sides call it."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule

    if kernel == "chunk":
        _fla_chunk_backward_here()
    rule = {"recurrent": fused_recurrent_gated_delta_rule, "chunk": chunk_gated_delta_rule}[kernel]
    return rule(
        q, k, v, g=g, beta=beta, scale=scale, initial_state=initial_state,
        output_final_state=True, use_qk_l2norm_in_kernel=use_l2, cu_seqlens=cu_seqlens,
    )


def chunked_gated_delta_rule(q, k, v, g, beta, initial_state, scale, cu_seqlens, use_l2, backend):
    """Differentiable chunked evaluation of the rule: (output, final state)."""
    if use_l2:
        q, k = _l2norm(q), _l2norm(k)
    if backend == "fla":
        return _fla("chunk", q, k, v, g, beta, initial_state, scale, cu_seqlens)
    return _torch_chunked(q, k, v, g, beta, initial_state, scale, cu_seqlens)


def chunk_backward_backend(backend: str, q) -> str:
    """'auto': fla's chunked backward for GPU tensors, the torch rule for CPU ones."""
    if backend != "auto":
        return backend
    return "fla" if q.is_cuda else "torch"


class _KernelForwardChunkedBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, beta, initial_state, scale, cu_seqlens, use_l2, forward, backend):
        out, final_state = _fla(forward, q, k, v, g, beta, initial_state, scale, cu_seqlens, use_l2)
        ctx.save_for_backward(q, k, v, g, beta, initial_state)
        ctx.args = (scale, cu_seqlens, use_l2, backend)
        return out, final_state

    @staticmethod
    def backward(ctx, d_out, d_final_state):
        inputs = [t.detach().requires_grad_(True) for t in ctx.saved_tensors]
        scale, cu_seqlens, use_l2, backend = ctx.args
        with torch.enable_grad():
            out, final_state = chunked_gated_delta_rule(*inputs, scale, cu_seqlens, use_l2,
                                                        chunk_backward_backend(backend, inputs[0]))
            outputs, grads = [out], [d_out]
            if d_final_state is not None:
                outputs.append(final_state)
                grads.append(d_final_state)
            input_grads = torch.autograd.grad(outputs, inputs, grads, allow_unused=True)
        return (*input_grads, None, None, None, None, None)


def gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    *,
    forward: str = "recurrent",
    chunk_backend: str = "torch",
    **unused,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """megatron-core's GatedDeltaRuleInterface. q, k [B, T, H, K]; v [B, T, H, V];
    g, beta [B, T, H]; initial_state [N, H, K, V] fp32 (zeros when None); varlen needs B = 1."""
    if forward not in FORWARD_KERNELS:
        raise ValueError(f"forward kernel {forward!r}: expected one of {FORWARD_KERNELS}")
    if chunk_backend not in CHUNK_BACKENDS:
        raise ValueError(f"chunk backend {chunk_backend!r}: expected one of {CHUNK_BACKENDS}")
    if q.shape[2] != v.shape[2]:
        raise ValueError("expand q/k heads to the value heads before the rule (as megatron-core does)")
    num_sequences = q.shape[0] if cu_seqlens is None else cu_seqlens.numel() - 1
    if initial_state is None:
        initial_state = q.new_zeros(num_sequences, v.shape[2], q.shape[-1], v.shape[-1],
                                    dtype=torch.float32)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if forward == "chunk" and chunk_backward_backend(chunk_backend, q) == "fla":
        out, final_state = _fla("chunk", q, k, v, g, beta, initial_state, scale, cu_seqlens,
                                use_qk_l2norm_in_kernel)
    else:
        out, final_state = _KernelForwardChunkedBackward.apply(
            q, k, v, g, beta, initial_state, scale, cu_seqlens, use_qk_l2norm_in_kernel, forward,
            chunk_backend,
        )
    return out, (final_state if output_final_state else None)
