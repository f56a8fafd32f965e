"""Do two metrics JSONL files (pretrain_rl.py --rl-metrics-jsonl) hold the same step records?
Measurements of the machine (`time/*`, `throughput/*`, `memory/*`) are left out; every other
value must be equal (==).
Exit status 1 and one line per difference otherwise.

  python tools/compare_metrics.py results/rl_tiny_h200.jsonl runs/tiny_sort/metrics.jsonl
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_rl_bi.reporting.metrics import read_step_records  # noqa: E402

TIMING_PREFIXES = ("time/", "throughput/", "memory/")


def differences(expected: dict[int, dict], actual: dict[int, dict]) -> list[str]:
    found = []
    if sorted(expected) != sorted(actual):
        found.append(f"steps differ: {sorted(set(expected) ^ set(actual))[:10]} in one file only")
    for step in sorted(set(expected) & set(actual)):
        keys = {k for k in expected[step].keys() | actual[step].keys()
                if not k.startswith(TIMING_PREFIXES)}
        for key in sorted(keys):
            a, b = expected[step].get(key, "<missing>"), actual[step].get(key, "<missing>")
            if a != b:
                found.append(f"step {step} {key}: {a!r} != {b!r}")
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("expected", help="reference metrics JSONL")
    parser.add_argument("actual", help="metrics JSONL to check")
    args = parser.parse_args()
    found = differences(read_step_records(args.expected), read_step_records(args.actual))
    print("\n".join(found) if found else f"identical step records (timings aside): {args.actual}")
    sys.exit(1 if found else 0)


if __name__ == "__main__":
    main()
