"""The fused rope's before and after: megatron-core's unfused rope (`_apply_rotary_pos_emb_bshd`,
what the local layers ran before models/rope.py was installed) against `fused_rope`, on q and k
of a decode step and of a trainer batch, bf16. Per call: the host's time to launch it and the
GPU's time (bench/decode_tail.py's measure), and whether the two give the same bits (forward,
and the input's gradient where the row times the backward too).

  python bench/rope.py --output results/bench_rope_h200.json
"""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.decode_tail import build_parser, host_and_gpu_us  # noqa: E402
from bench.report import write_report  # noqa: E402

from megatron_rl_bi.models.rope import fused_rope, megatron_cores_rope  # noqa: E402
from megatron_rl_bi.reporting.provenance import provenance  # noqa: E402

# Calls queued behind the sleep. megatron-core's rope is a dozen kernels a call, more with the
# backward: at 100 calls (59942f8's run) its host time a call came out at the sleep's length over
# the calls, about 1 ms, the host waiting for room in the launch queue: only an upper bound.
CALLS = 25
# (name, tokens, query heads, key-value heads, head dim, with the backward)
SHAPES = [
    ("dense16 decode, 32 requests", 32, 16, 8, 128, False),
    ("Qwen3-4B decode, 64 requests", 64, 32, 8, 128, False),
    ("Qwen3-4B trainer, 16K tokens", 16384, 32, 8, 128, True),
]


def _inputs(tokens, heads, dim):
    torch.manual_seed(0)
    t = torch.randn(tokens, 1, heads, dim, device="cuda").bfloat16().requires_grad_(True)
    inv = 1.0 / (1_000_000 ** (torch.arange(0, dim, 2, device="cuda").float() / dim))
    freqs = torch.outer(torch.randint(0, 8192, (tokens,), device="cuda").float(), inv)
    return t, torch.cat([freqs, freqs], dim=-1)[:, None, None, :]


def _call(rope, t, freqs, backward):
    """One rope of q or k; with `backward`, its backward too (the gradient of the output's sum)."""
    if not backward:
        with torch.no_grad():
            return rope(t, freqs), None
    t.grad = None
    out = rope(t, freqs)
    out.backward(torch.ones_like(out))
    return out.detach(), t.grad


def measure(calls: int) -> list[dict]:
    ropes = {"megatron-core": megatron_cores_rope(), "fused": fused_rope}
    rows = []
    for name, tokens, q_heads, kv_heads, dim, backward in SHAPES:
        for tensor, heads in (("q", q_heads), ("k", kv_heads)):
            t, freqs = _inputs(tokens, heads, dim)
            results = {variant: _call(rope, t, freqs, backward) for variant, rope in ropes.items()}
            bits_equal = all(
                (a is None and b is None) or torch.equal(a, b)
                for a, b in zip(results["megatron-core"], results["fused"]))
            for variant, rope in ropes.items():
                rows.append({"shape": name, "tensor": tensor, "variant": variant, "backward": backward,
                             "bits_equal_megatron_core": bits_equal,
                             **host_and_gpu_us(lambda: _call(rope, t, freqs, backward), calls)})
    return rows


def main() -> None:
    args = build_parser(__doc__, calls=CALLS).parse_args()
    rows = measure(args.calls)
    summary = {f"{r['shape']} {r['tensor']} {r['variant']}":
               f"host {r['host_us']:.1f} us, GPU {r['gpu_us']:.1f} us, bits equal {r['bits_equal_megatron_core']}"
               for r in rows}
    write_report({**provenance(), "calls": args.calls, "rows": rows}, summary, args.output)


if __name__ == "__main__":
    main()
