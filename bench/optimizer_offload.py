"""The optimizer's state to the host and back, as around each generation with
--rl-offload-optimizer-during-inference: megatron-core's `MegatronOptimizer.offload_to_cpu` and
`restore_from_cpu` against this package's (rl/optimizer_offload.py), on an Adam state of the given
size, one after the other in one run; seconds of each round trip's two halves, and whether the
state came back bit for bit.

  python bench/optimizer_offload.py --state-gib 42 --output results/bench_optimizer_offload_h200.json
"""

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.report import positive_int, write_report  # noqa: E402

from megatron_rl_bi.reporting.provenance import provenance  # noqa: E402
from megatron_rl_bi.rl.optimizer_offload import generating, optimizer_tensors  # noqa: E402

PARAMETER_NUMEL = 1 << 26  # a large layer's weight


class _Optimizer:
    """What megatron-core's optimizer offers the offload: its inner torch optimizer."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.optimizer = optimizer


def _adam(state_gib: float) -> _Optimizer:
    """Adam after one step over fp32 parameters: 12 bytes a parameter (weights and two moments)."""
    numel = int(state_gib * 2**30 / 12)
    generator = torch.Generator(device="cuda").manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(min(PARAMETER_NUMEL, numel - start), device="cuda",
                                             generator=generator))
              for start in range(0, numel, PARAMETER_NUMEL)]
    adam = torch.optim.Adam(params, lr=1e-3)
    for param in params:
        param.grad = torch.randn(param.shape, device="cuda", generator=generator)
    adam.step()
    for param in params:
        param.grad = None
    return _Optimizer(adam)


def _round_trip(offload, restore) -> tuple[float, float]:
    torch.cuda.synchronize()
    start = time.perf_counter()
    offload()
    torch.cuda.synchronize()
    parked = time.perf_counter()
    restore()
    torch.cuda.synchronize()
    return parked - start, time.perf_counter() - parked


def _ours(optimizer):
    phase = generating(optimizer, True)
    return phase.__enter__, lambda: phase.__exit__(None, None, None)


def measure(state_gib: float, rounds: int) -> dict:
    from megatron.core.optimizer.optimizer import MegatronOptimizer

    optimizer = _adam(state_gib)
    expected = [t.clone() for t in optimizer_tensors(optimizer)]
    ways = {"megatron_core": lambda: (lambda: MegatronOptimizer.offload_to_cpu(optimizer),
                                      lambda: MegatronOptimizer.restore_from_cpu(optimizer)),
            "page_locked": lambda: _ours(optimizer)}
    results = {}
    for name, halves in ways.items():
        trips = [_round_trip(*halves()) for _ in range(rounds)]
        results[name] = {"offload_s": [t[0] for t in trips], "restore_s": [t[1] for t in trips],
                         "bits_equal": all(torch.equal(a, b) for a, b in zip(optimizer_tensors(optimizer), expected))}
    later = {name: statistics.median(sum(t) for t in zip(r["offload_s"][1:], r["restore_s"][1:]))
             for name, r in results.items()}
    return {**results, "round_trip_s_after_the_first": later,
            "ratio_page_locked_vs_megatron_core": later["page_locked"] / later["megatron_core"]}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--state-gib", type=float, default=42.0,
                        help="Adam state on the GPU (fp32 weights and two moments)")
    parser.add_argument("--rounds", type=positive_int, default=3, help="round trips of each way (>= 2)")
    parser.add_argument("--output", default=None, help="JSON file to write")
    return parser


def main():
    args = build_parser().parse_args()
    if args.rounds < 2:
        raise SystemExit("--rounds must be >= 2: the first round of the page-locked way allocates its buffers")
    report = {**provenance(), "config": vars(args), "results": measure(args.state_gib, args.rounds)}
    write_report(report, report["results"], args.output)


if __name__ == "__main__":
    main()
