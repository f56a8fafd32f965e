"""GDN rule speed on one GPU, as ratios within one run: the BI rule (fla recurrent forward,
chunked backward; both chunked backends where fla allows its own) against fla's chunked kernel.

  python bench/gdn_rule.py --output results/bench_gdn_rule_h200.json
"""

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.timing import seconds  # noqa: E402

from megatron_rl_bi import compat  # noqa: E402
from megatron_rl_bi.models.gdn_rule import recurrent_gated_delta_rule  # noqa: E402
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
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    inputs, cu = _inputs(tokens, sequences, heads, dim)

    def step(rule):
        out, _ = rule(*inputs[:3], g=inputs[3], beta=inputs[4], cu_seqlens=cu)
        out.float().sum().backward()

    results = {}
    with torch.no_grad():
        results["recurrent_forward_ms"] = 1000 * seconds(
            lambda: recurrent_gated_delta_rule(*inputs[:3], inputs[3], inputs[4], cu_seqlens=cu), 10)
    results["bi_torch_backward_step_ms"] = 1000 * seconds(
        lambda: step(lambda *a, **k: recurrent_gated_delta_rule(*a, chunk_backend="torch", **k)), 3)
    if compat.fla_chunk_backward_works():
        results["bi_fla_backward_step_ms"] = 1000 * seconds(
            lambda: step(lambda *a, **k: recurrent_gated_delta_rule(*a, chunk_backend="fla", **k)), 10)
        results["fla_chunk_step_ms"] = 1000 * seconds(lambda: step(chunk_gated_delta_rule), 10)
        results["ratio_bi_fla_vs_fla_chunk"] = (
            results["bi_fla_backward_step_ms"] / results["fla_chunk_step_ms"])
    return results


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--sequences", type=int, default=32)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--output", default=None)
    args = parser.parse_args()
    report = {**provenance(), "config": vars(args),
              "fla_chunk_backward_works": compat.fla_chunk_backward_works(),
              "results": measure(args.tokens, args.sequences, args.heads, args.head_dim)}
    print(json.dumps(report["results"], indent=2))
    if args.output:
        with open(args.output, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
