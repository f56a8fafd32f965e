"""Reward and parity curves from a pretrain_rl.py metrics JSONL, to PNG (needs matplotlib).

  python tools/plot_metrics.py runs/tiny_sort/metrics.jsonl runs/tiny_sort/curves.png
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_rl_bi.reporting.metrics import read_step_records  # noqa: E402


def plot(records: list[dict], output: str, title: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ImportError("plot_metrics needs `pip install matplotlib`") from exc
    steps = [r["step"] for r in records]
    fig, (reward_ax, parity_ax) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    reward_ax.plot(steps, [r["reward/task_mean"] for r in records], label="task reward (mean)")
    reward_ax.set_ylabel("reward")
    reward_ax.legend(loc="lower right")
    reward_ax.set_title(title)
    for key, label in (("bit_wise/logprob_diff/max", "max |diff|"),
                       ("bit_wise/logprob_diff/abs_mean", "mean |diff|"),
                       ("bit_wise/ratio_tokens_different", "tokens different")):
        parity_ax.plot(steps, [r[key] for r in records], label=label)
    parity_ax.set_ylabel("trainer vs engine logprob")
    parity_ax.set_xlabel("RL step")
    parity_ax.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(output, dpi=120)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("jsonl", help="metrics JSONL of pretrain_rl.py")
    parser.add_argument("png", help="image to write")
    parser.add_argument("--title", default=None, help="figure title (default: the JSONL path)")
    return parser


def main() -> None:
    args = build_parser().parse_args()
    records = [r for _, r in sorted(read_step_records(args.jsonl).items())]
    plot(records, args.png, args.title or args.jsonl)


if __name__ == "__main__":
    main()
