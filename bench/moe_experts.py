r"""The experts' grouped GEMM's before and after: a MoE layer at Qwen3-30B-A3B's widths (hidden 2048,
128 experts, 8 a token, 768 wide, bf16, BI mode, no autograd as in the engine) with its experts
one after another (megatron-core's SequentialMLP.forward, what BI mode ran before) and at once
(models/moe.py's BatchInvariantExperts: both linears one grouped launch each), on the same
tokens: the layer's wall time per call (host included: a decode step is host-bound) and whether
the two give the same bits.

  python bench/moe_experts.py --output results/bench_moe_experts_h200.json
"""

import argparse
import os
import sys
from functools import partial

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.report import positive_int, seconds, write_report  # noqa: E402

from megatron_rl_bi import bi  # noqa: E402
from megatron_rl_bi.distributed import initialize_distributed  # noqa: E402
from megatron_rl_bi.models import moe  # noqa: E402
from megatron_rl_bi.reporting.provenance import provenance  # noqa: E402

# tokens a call: decode steps of 16 and 128 requests, and a prefill chunk
TOKENS = (16, 128, 1024)


def build_layer() -> torch.nn.Module:
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(num_layers=1, hidden_size=2048, num_attention_heads=32, ffn_hidden_size=6144,
                               num_moe_experts=128, moe_router_topk=8, moe_ffn_hidden_size=768,
                               add_bias_linear=False, gated_linear_unit=True, bf16=True,
                               params_dtype=torch.bfloat16, moe_router_dtype="fp32", moe_aux_loss_coeff=0.0)
    return moe.moe_mlp(ColumnParallelLinear, RowParallelLinear)(config=config).cuda()


def measure(layer: torch.nn.Module, tokens: int, repeats: int) -> dict:
    from megatron.core.transformer.moe.experts import SequentialMLP

    torch.manual_seed(tokens)
    x = torch.randn(tokens, 1, 2048, device="cuda", dtype=torch.bfloat16)
    experts = layer.experts
    at_once = experts.forward
    one_after_another = partial(SequentialMLP.forward, experts)
    results = {}
    for name, forward in (("one_after_another", one_after_another), ("at_once", at_once)):
        experts.forward = forward
        results[name] = (seconds(lambda: layer(x), repeats), layer(x)[0])
        del experts.forward
    (before, before_out), (after, after_out) = results["one_after_another"], results["at_once"]
    return {"tokens": tokens, "one_after_another_ms": before * 1e3, "at_once_ms": after * 1e3,
            "speedup": before / after, "same_bits": torch.equal(before_out, after_out)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", help="the JSON report")
    parser.add_argument("--repeats", type=positive_int, default=20)
    args = parser.parse_args()
    initialize_distributed(seed=1234)
    layer = build_layer()
    bi.enable()
    with torch.no_grad():
        rows = [measure(layer, tokens, args.repeats) for tokens in TOKENS]
    report = {**provenance(), "repeats": args.repeats, "layer": "Qwen3-30B-A3B widths, one MoE layer",
              "rows": rows}
    write_report(report, {"rows": rows}, args.output)
    if not all(row["same_bits"] for row in rows):
        sys.exit("the two paths gave other bits")


if __name__ == "__main__":
    main()
