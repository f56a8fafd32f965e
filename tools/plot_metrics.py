"""Reward and parity curves from pretrain_rl.py metrics JSONL files, to PNG (needs matplotlib).
Several runs (e.g. the same job in default and BI mode) share the axes.

  python tools/plot_metrics.py runs/tiny_sort/metrics.jsonl runs/tiny_sort/curves.png
  python tools/plot_metrics.py default.jsonl out.png --label default --also bi.jsonl:BI
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_rl_bi.reporting.metrics import read_step_records  # noqa: E402

PARITY = (("bit_wise/logprob_diff/max", "max |diff|"),
          ("bit_wise/logprob_diff/abs_mean", "mean |diff|"),
          ("bit_wise/ratio_tokens_different", "tokens different"))


def plot(runs: list[tuple[str, list[dict]]], output: str, title: str) -> None:
    """`runs`: (label, step records) each; one reward curve and three parity curves per run."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ImportError("plot_metrics needs `pip install matplotlib`") from exc
    fig, (reward_ax, parity_ax) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    for label, records in runs:
        steps = [r["step"] for r in records]
        prefix = f"{label}: " if label else ""
        reward_ax.plot(steps, [r["reward/task_mean"] for r in records],
                       label=f"{prefix}task reward (mean)")
        for key, name in PARITY:
            parity_ax.plot(steps, [r[key] for r in records], label=prefix + name)
    reward_ax.set_ylabel("reward")
    reward_ax.legend(loc="lower right")
    reward_ax.set_title(title)
    parity_ax.set_ylabel("trainer vs engine logprob")
    parity_ax.set_xlabel("RL step")
    parity_ax.legend(loc="upper right", fontsize="small")
    fig.tight_layout()
    fig.savefig(output, dpi=120)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("jsonl", help="metrics JSONL of pretrain_rl.py")
    parser.add_argument("png", help="image to write")
    parser.add_argument("--title", default=None, help="figure title (default: the JSONL path)")
    parser.add_argument("--label", default="", help="legend label of the first run")
    parser.add_argument("--also", action="append", default=[], metavar="JSONL:LABEL",
                        help="another run to draw on the same axes (repeatable)")
    return parser


def _records(path: str) -> list[dict]:
    return [r for _, r in sorted(read_step_records(path).items())]


def main() -> None:
    parser = build_parser()
    args = parser.parse_args()
    sources = [(args.label, args.jsonl)]
    for spec in args.also:
        path, _, label = spec.rpartition(":")
        if not path:
            parser.error(f"--also {spec}: expected JSONL:LABEL")
        sources.append((label, path))
    try:
        runs = [(label, _records(path)) for label, path in sources]
    except (OSError, ValueError) as exc:
        parser.error(str(exc))
    plot(runs, args.png, args.title or args.jsonl)
    print(f"curves: {args.png}")


if __name__ == "__main__":
    main()
