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
`chunk_gated_delta_rule` and its Triton backward, varlen-native; fla 0.6.0 refuses it on Hopper
with Triton >= 3.4 and < 3.7.1, see `compat.fla_chunk_backward_works`), and 'auto' (what layers
train with): fla's on a GPU where its gradients are right (`fla_backward_checked`), else torch's.
"""

import contextlib
import functools

import torch
import torch.nn.functional as F
from torch.nn.utils.rnn import pad_sequence

from megatron_rl_bi import compat
from megatron_rl_bi.numerics import relative_l2_error
from megatron_rl_bi.packing import sequence_lengths

FORWARD_KERNELS = ("recurrent", "chunk")
CHUNK_BACKENDS = ("torch", "fla", "auto")
# fla's bf16 kernels against the fp32 torch rule: the RMS of the difference over the RMS of the
# rule's gradient (the measure fla's own tests bound, at 0.02 at most, against fp32 references);
# the miscompile of fla issue 640 gives ratios near 0.5.
CHECK_ERROR_RATIO = 0.02


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


def _fla(kernel, q, k, v, g, beta, initial_state, scale, cu_seqlens, use_l2=False):
    """fla's 'recurrent' (fused_recurrent) or 'chunk' rule, called the one way both sides call it."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule

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


def _check_inputs(heads, key_dim, value_dim, dtypes, lengths=(100, 300, 624)):
    """A packed random problem of the layer's sizes and dtypes (q, k, v, g, beta), on the GPU."""
    generator = torch.Generator(device="cuda").manual_seed(0)
    tokens = sum(lengths)

    def rand(*shape, dtype=torch.float32):
        return torch.randn(*shape, device="cuda", generator=generator).to(dtype)

    q, k = (_l2norm(rand(1, tokens, heads, key_dim)).to(dtypes[0]) for _ in range(2))
    v = rand(1, tokens, heads, value_dim, dtype=dtypes[0])
    g = (-0.1 * rand(1, tokens, heads).abs()).to(dtypes[1])
    beta = torch.sigmoid(rand(1, tokens, heads)).to(dtypes[2])
    state = 0.1 * rand(len(lengths), heads, key_dim, value_dim)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device="cuda", dtype=torch.int32)
    return [q, k, v, g, beta, state], cu


def _gradients(inputs, cu, backend) -> list[torch.Tensor]:
    """Each input's gradient through the chunked rule of `backend`, under seeded cotangents."""
    inputs = [t.detach().clone().requires_grad_(True) for t in inputs]
    with torch.enable_grad():  # called from a backward, where autograd is off
        out, state = chunked_gated_delta_rule(*inputs, inputs[0].shape[-1] ** -0.5, cu, False, backend)
        generator = torch.Generator(device=out.device).manual_seed(1)
        cotangents = [torch.randn(t.shape, device=t.device, generator=generator).to(t.dtype) for t in (out, state)]
        return list(torch.autograd.grad([out, state], inputs, cotangents))


@functools.cache
def fla_backward_checked(heads: int, key_dim: int, value_dim: int, dtypes: tuple) -> bool:
    """Whether fla's chunked backward may train a layer of these sizes and dtypes here. Where fla
    runs it itself, yes. Where fla 0.6.0 refuses it (Hopper with Triton >= 3.4 and < 3.7.1: fla
    issue 640, a miscompile of chunk_bwd_kernel_dqkwg found at key tiles of 64; on Hopper fla
    tiles keys of 128 whole), the refused backward runs once on a packed random problem and is
    kept only if every gradient is within CHECK_ERROR_RATIO of the torch rule's. The kernels
    it compiled and autotuned there are the ones training runs: their autotune keys are the
    sizes and dtypes, not the lengths."""
    if compat.fla_chunk_backward_works():
        return True
    inputs, cu = _check_inputs(heads, key_dim, value_dim, dtypes)
    with compat.fla_hopper_backward_guard_lifted():
        fla = _gradients(inputs, cu, "fla")
    reference = _gradients(inputs, cu, "torch")
    return all(relative_l2_error(a, b) <= CHECK_ERROR_RATIO for a, b in zip(fla, reference))


def chunk_backward_backend(backend: str, q, v, g, beta) -> str:
    """'auto': fla's backward on a GPU where it is right for these tensors, else the torch rule."""
    if backend != "auto":
        return backend
    if not q.is_cuda:  # fla's chunked kernels have no CPU path
        return "torch"
    dtypes = (q.dtype, g.dtype, beta.dtype)
    return "fla" if fla_backward_checked(q.shape[2], q.shape[3], v.shape[3], dtypes) else "torch"


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
        backend = chunk_backward_backend(backend, *[inputs[i] for i in (0, 2, 3, 4)])
        refused = backend == "fla" and not compat.fla_chunk_backward_works()
        with torch.enable_grad(), (compat.fla_hopper_backward_guard_lifted() if refused else contextlib.nullcontext()):
            out, final_state = chunked_gated_delta_rule(*inputs, scale, cu_seqlens, use_l2, backend)
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
    fla_throughout = chunk_backend == "fla" or (chunk_backend == "auto" and q.is_cuda and compat.fla_chunk_backward_works())
    if forward == "chunk" and fla_throughout:
        out, final_state = _fla("chunk", q, k, v, g, beta, initial_state, scale, cu_seqlens,
                                use_qk_l2norm_in_kernel)
    else:
        out, final_state = _KernelForwardChunkedBackward.apply(
            q, k, v, g, beta, initial_state, scale, cu_seqlens, use_qk_l2norm_in_kernel, forward,
            chunk_backend,
        )
    return out, (final_state if output_final_state else None)
