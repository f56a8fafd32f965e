r"""Cost of batch invariance on one GPU, as BI / default time ratios measured in one run: a packed
trainer forward+backward, the RL update (with the optimizer) and an engine generation, on the
model built from the Megatron flags given (e.g. the dense parity model of
examples/parity_dense.sh).

  python bench/bi_overhead.py <Megatron model flags> --flash-attention-version 4 \
      --bench-output results/bench_bi_overhead_h200.json
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.report import positive_int, seconds, write_report  # noqa: E402
from bench.workload import (  # noqa: E402
    add_workload_args,
    build_workload,
    check_bi_parity,
    run_modes,
)

from megatron_rl_bi import bi  # noqa: E402
from megatron_rl_bi.models.build import cpu_state_dict  # noqa: E402


def add_bench_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    add_workload_args(parser)
    group = parser.add_argument_group("bench")
    group.add_argument("--bench-repeats", type=positive_int, default=3)
    group.add_argument("--bench-output", default=None)
    return parser


def measure(args, batch_invariant: bool, weights) -> tuple[dict, dict]:
    """Seconds of a trainer forward+backward and of a generation in one kernel mode, and the
    model's weights (so the other mode runs the same ones)."""
    with bi.batch_invariant(batch_invariant):
        work = build_workload(args, weights)
        rollouts = work.rollouts(args.bench_new_tokens)
        result = {
            "train_fwd_bwd_s": seconds(work.train_step, args.bench_repeats),
            "generate_s": seconds(lambda: work.generate(args.bench_new_tokens), args.bench_repeats),
            "rl_update_s": seconds(lambda: work.rl_update(rollouts), args.bench_repeats),
            "parity_max": work.parity_max(),
        }
        state = cpu_state_dict(work.model)
    return result, state


def main() -> None:
    args, report = run_modes(add_bench_args, measure)
    if "bi" in report and "default" in report:
        report["ratios_bi_over_default"] = {k: report["bi"][k] / report["default"][k]
                                            for k in ("train_fwd_bwd_s", "rl_update_s", "generate_s")}
    write_report(report, report.get("ratios_bi_over_default") or {m: report[m] for m in ("bi", "default") if m in report},
                 args.bench_output)
    check_bi_parity(report)


if __name__ == "__main__":
    main()
