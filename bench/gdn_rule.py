"""GDN rule speed on one GPU, as ratios within one run: the BI rule (fla recurrent forward,
chunked backward) against the chunked alternatives that run here: megatron-core's torch chunked
rule under autograd (what its deterministic mode trains with), fla's chunked forward, and fla's
chunked step; where fla refuses its chunked backward (Hopper with Triton 3.4-3.7.0), that step with
the refusal lifted and fla's own kernels (`guard_lifted_*`); and the step layers train with (the
'auto' backward: fla's, with this package's Triton `chunk_bwd_dqkwg` where fla refuses its own),
with how far each backward's gradients are from the torch rule's (relative L2, per input); the BI
step's peak memory above its inputs with the torch rule's backward and with the 'auto' one. The
kernel against its torch reference, the kernel's before (`dqkwg_*`): the step alone, each, on the
arguments the BI step's backward gives it, and the BI step with the torch step in the kernel's
place.

  python bench/gdn_rule.py --output results/bench_gdn_rule_h200.json
"""

import argparse
import os
import sys
from functools import partial

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.report import peak_mib, seconds, write_report  # noqa: E402

from megatron_rl_bi import compat  # noqa: E402
from megatron_rl_bi.models.gdn_rule import chunked_gated_delta_rule, gated_delta_rule  # noqa: E402
from megatron_rl_bi.numerics import relative_l2_error  # noqa: E402
from megatron_rl_bi.reporting.provenance import provenance  # noqa: E402


def _inputs(tokens, sequences, heads, dim):
    torch.manual_seed(0)
    shape = (1, tokens, heads)
    q, k = (torch.randn(*shape, dim, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    k = torch.nn.functional.normalize(k.float(), dim=-1).bfloat16()
    v = torch.randn(*shape, dim, device="cuda", dtype=torch.bfloat16)
    g = -torch.rand(*shape, device="cuda") * 0.1
    beta = torch.rand(*shape, device="cuda").bfloat16()
    cu = torch.linspace(0, tokens, sequences + 1, device="cuda").round().int()
    return [t.requires_grad_(True) for t in (q, k, v, g, beta)], cu


def measure(tokens, sequences, heads, dim) -> dict:
    """Milliseconds per call; a "step" is forward + backward of one packed batch."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    inputs, cu = _inputs(tokens, sequences, heads, dim)
    initial = torch.zeros(sequences, heads, dim, dim, device="cuda")
    scale = dim**-0.5

    def step(rule):
        out, _ = rule(*inputs[:3], g=inputs[3], beta=inputs[4], cu_seqlens=cu)
        out.float().sum().backward()

    def torch_chunked(q, k, v, g, beta, cu_seqlens):
        return chunked_gated_delta_rule(q, k, v, g, beta, initial, scale, cu_seqlens, False, "torch")

    step(partial(gated_delta_rule, chunk_backend="auto"))  # sets up the layers' backward (the kernel where fla refuses)
    ms = {}
    with torch.no_grad():
        ms["recurrent_forward_ms"] = 1000 * seconds(
            lambda: gated_delta_rule(*inputs, cu_seqlens=cu), 10)
        ms["fla_chunk_forward_ms"] = 1000 * seconds(
            lambda: chunk_gated_delta_rule(*inputs[:3], g=inputs[3], beta=inputs[4], cu_seqlens=cu), 10)
    ms["bi_step_torch_backward_ms"] = 1000 * seconds(
        lambda: step(partial(gated_delta_rule, chunk_backend="torch")), 3)
    ms["torch_chunked_step_ms"] = 1000 * seconds(lambda: step(torch_chunked), 3)
    ms["ratio_bi_step_vs_torch_chunked_step"] = (
        ms["bi_step_torch_backward_ms"] / ms["torch_chunked_step_ms"])
    ms["ratio_recurrent_vs_chunk_forward"] = (
        ms["recurrent_forward_ms"] / ms["fla_chunk_forward_ms"])
    ms.update(_fla_backward(step, chunk_gated_delta_rule))  # the kernel stands in where fla refuses
    ms["auto_gradient_error"] = _gradient_error(inputs, step, "auto")
    ms["bi_step_auto_ms"] = 1000 * seconds(lambda: step(partial(gated_delta_rule, chunk_backend="auto")), 10)
    ms.update(_dqkwg_before_after(step))
    for name, backend in (("torch_backward", "torch"), ("auto", "auto")):  # the backward's workspace
        ms[f"bi_step_{name}_peak_mib"] = peak_mib(lambda: step(partial(gated_delta_rule, chunk_backend=backend)))
    print(ms, flush=True)  # fla's refused kernels come last: a fault there must not take these
    if not compat.fla_chunk_backward_works():  # fla's own refused kernels, for comparison
        with compat.fla_hopper_backward_guard_lifted():
            own = {**_fla_backward(step, chunk_gated_delta_rule), "gradient_error": _gradient_error(inputs, step, "fla")}
        ms.update({f"guard_lifted_{key}": value for key, value in own.items()})
    fla_step = ms.get("guard_lifted_fla_chunk_step_ms", ms["fla_chunk_step_ms"])  # fla's own kernels
    ms["ratio_bi_step_auto_vs_fla_chunk_step"] = ms["bi_step_auto_ms"] / fla_step
    ms["ratio_bi_step_auto_torch_dqkwg_vs_fla_chunk_step"] = ms["bi_step_auto_torch_dqkwg_ms"] / fla_step
    return ms


def _fla_backward(step, chunk_gated_delta_rule) -> dict:
    ms = {"bi_step_fla_backward_ms": 1000 * seconds(lambda: step(partial(gated_delta_rule, chunk_backend="fla")), 10),
          "fla_chunk_step_ms": 1000 * seconds(lambda: step(chunk_gated_delta_rule), 10)}
    ms["ratio_bi_step_vs_fla_chunk_step"] = ms["bi_step_fla_backward_ms"] / ms["fla_chunk_step_ms"]
    return ms


def _dqkwg_before_after(step) -> dict:
    """The gated `chunk_bwd_dqkwg` step alone, the torch one and the kernel, on the arguments the
    'auto' backward gives it, how far the kernel's outputs are from the torch step's (relative L2),
    and the BI step with the torch step in the kernel's place (the kernel's before)."""
    import fla.ops.gated_delta_rule.chunk as gated_delta_rule_chunk

    from megatron_rl_bi.models import gdn_dqkwg, gdn_dqkwg_triton

    calls, installed = [], gated_delta_rule_chunk.chunk_bwd_dqkwg

    def record(*args, **kwargs):
        calls.append((args, kwargs))
        return installed(*args, **kwargs)

    steps = {"torch": gdn_dqkwg.chunk_bwd_dqkwg, "triton": gdn_dqkwg_triton.chunk_bwd_dqkwg}
    try:
        compat.replace_fla_gated_dqkwg(record)
        step(partial(gated_delta_rule, chunk_backend="auto"))
        args, kwargs = calls[0]
        ms = {f"dqkwg_{name}_ms": 1000 * seconds(lambda: call(*args, **kwargs), 10) for name, call in steps.items()}
        ms["dqkwg_triton_error"] = {name: relative_l2_error(got, want) for name, got, want in zip(
            ("dq", "dk", "dw", "dg"), steps["triton"](*args, **kwargs), steps["torch"](*args, **kwargs))}
        compat.replace_fla_gated_dqkwg(steps["torch"])
        ms["bi_step_auto_torch_dqkwg_ms"] = 1000 * seconds(
            lambda: step(partial(gated_delta_rule, chunk_backend="auto")), 10)
    finally:
        compat.replace_fla_gated_dqkwg(installed)
    return ms


def _gradient_error(inputs, step, backend) -> dict:
    """Per input (q, k, v, g, beta): relative L2 distance of `backend`'s gradients from the torch
    rule's, both under the BI rule's recurrent forward."""
    grads = {}
    for name in ("torch", backend):
        for t in inputs:
            t.grad = None
        step(partial(gated_delta_rule, chunk_backend=name))
        grads[name] = [t.grad.float() for t in inputs]
    return {name: relative_l2_error(got, ref)
            for name, got, ref in zip(("q", "k", "v", "g", "beta"), grads[backend], grads["torch"])}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=16384, help="packed tokens per batch")
    parser.add_argument("--sequences", type=int, default=32, help="sequences per batch")
    parser.add_argument("--heads", type=int, default=16, help="value heads")
    parser.add_argument("--head-dim", type=int, default=128, help="key and value head dim")
    parser.add_argument("--output", default=None, help="JSON file to write")
    return parser


def main():
    args = build_parser().parse_args()
    report = {**provenance(), "config": vars(args),
              "fla_chunk_backward_works": compat.fla_chunk_backward_works(),
              "results": measure(args.tokens, args.sequences, args.heads, args.head_dim)}
    write_report(report, report["results"], args.output)


if __name__ == "__main__":
    main()
