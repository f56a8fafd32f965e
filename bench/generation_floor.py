r"""The least time each step's generation of an at-size run could take, from the bytes it must read
from HBM (issue 48's Qwen3-4B recipe step), beside the time it took: what is left to win in
generation, and what a step target asks of it.

A step's decode must read, at least: the weights once a decode step (the input embedding of an
untied model aside: a step reads a row of it per request), with at least tokens / requests-at-once
steps; for each generated token the KV cache of its response's earlier tokens in every attention
layer; and in a hybrid model each GDN layer's states (the conv state and the fp32 recurrent one),
read and written for each generated token. Each count is a lower bound: the prompts' tokens in
the contexts, the prefill and everything but HBM reads are left out, and the responses' context
reads are counted as if all had the mean length (x(x-1)/2 is convex: unequal lengths read more).
The floor's seconds are its bytes at the device's copy rate (bench/profile_steps.py measures it:
an H200's, 4.3e12 bytes a second).

  python bench/generation_floor.py results/rl_qwen3_4b_8k_h200_fused_rope.jsonl \
      --copy-bytes-per-s 4.3e12 --target-step-s 300 --output results/generation_floor_qwen3_4b_h200.json
"""

import argparse
import json
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_rl_bi.config.from_args import model_shape_from_args  # noqa: E402
from megatron_rl_bi.memory import decode_weight_bytes, gdn_state_bytes_per_request, kv_bytes_per_token  # noqa: E402
from megatron_rl_bi.reporting.metrics import header_flags, read_run_header, read_step_records  # noqa: E402
from megatron_rl_bi.reporting.provenance import provenance, stamped_commit  # noqa: E402


def context_reads_floor(responses: int, tokens: int) -> float:
    """Earlier tokens read by `tokens` generated tokens over `responses` responses: each token of a
    response reads those before it, sum L(L-1)/2, at least responses x m(m-1)/2 for the mean m."""
    mean = tokens / responses
    return responses * mean * (mean - 1) / 2


def decode_steps_floor(tokens: int, requests_at_once: int) -> int:
    return math.ceil(tokens / requests_at_once)


def read_bytes_per_step_unit(run: dict) -> dict:
    """From a run header's flags: the weights a decode step reads, the KV bytes of a context token
    over all attention layers, and the GDN state bytes (conv and rule) a generated token reads and
    writes."""
    flags = header_flags(run)
    if flags.num_experts:
        raise ValueError("a MoE model: a decode step reads only the experts its tokens are routed to, "
                         "not the planned weights")
    shape = model_shape_from_args(flags, flags.padded_vocab_size)
    return {"weights_per_decode_step": decode_weight_bytes(shape), "kv_per_context_token": kv_bytes_per_token(shape),
            "gdn_state_per_token": 2 * gdn_state_bytes_per_request(shape)}


def step_floor(units: dict, requests_at_once: int, record: dict, copy_bytes_per_s: float,
               target_step_s: float | None) -> dict:
    """One step's floor against its measured generation; with `target_step_s`, the fraction of
    the floor's pace its generation would need for the step to take that long, its training as
    it was."""
    responses, tokens = record["rollouts/generated"], record["bit_wise/tokens"]
    steps = decode_steps_floor(tokens, requests_at_once)
    floor_bytes = {"weights": steps * units["weights_per_decode_step"],
                   "kv_cache": context_reads_floor(responses, tokens) * units["kv_per_context_token"],
                   "gdn_states": tokens * units["gdn_state_per_token"]}
    floor_s = sum(floor_bytes.values()) / copy_bytes_per_s
    generation_s = record["time/generation_s"]
    row = {"step": record["step"], "responses": responses, "tokens": tokens, "decode_steps_floor": steps,
           "floor_bytes": floor_bytes, "floor_s": floor_s, "generation_s": generation_s,
           "generation_floor_fraction": floor_s / generation_s, "training_s": record["time/training_s"]}
    if target_step_s is not None:
        left = target_step_s - record["time/training_s"]
        row["target_generation_s"] = left
        row["target_floor_fraction"] = floor_s / left if left > 0 else None
    return row


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("metrics", help="an at-size run's metrics JSONL (examples/rl_at_size.sh)")
    parser.add_argument("--copy-bytes-per-s", type=float, required=True,
                        help="the device's HBM copy rate (bench/profile_steps.py's hbm_copy_bytes_per_s)")
    parser.add_argument("--target-step-s", type=float, default=None, help="a step time to set the floor against")
    parser.add_argument("--output", required=True, help="the report (JSON)")
    return parser


def main() -> None:
    args = build_parser().parse_args()
    run = read_run_header(args.metrics)
    if "memory_plan" not in run:
        raise ValueError(f"{args.metrics}: its run header has no memory plan (the requests decoded at once)")
    units = read_bytes_per_step_unit(run)
    requests_at_once = run["memory_plan"]["requests_at_once"]
    steps = [step_floor(units, requests_at_once, record, args.copy_bytes_per_s, args.target_step_s)
             for record in read_step_records(args.metrics).values()]
    report = {**provenance(), "metrics": args.metrics, "run_device": run["device"], "run_commit": stamped_commit(run),
              "copy_bytes_per_s": args.copy_bytes_per_s, "target_step_s": args.target_step_s,
              "requests_at_once": requests_at_once, "bytes": units, "steps": steps}
    with open(args.output, "w") as file:
        json.dump(report, file, indent=1)
    for row in steps:
        target = f", a {args.target_step_s:.0f} s step needs {row['target_floor_fraction']:.2f} of it" \
            if args.target_step_s is not None and row["target_floor_fraction"] is not None else ""
        print(f"step {row['step']}: generation {row['generation_s']:.0f} s, its floor {row['floor_s']:.0f} s "
              f"({row['generation_floor_fraction']:.2f} of the floor's pace){target}")


if __name__ == "__main__":
    main()
