"""Does a metrics JSONL (pretrain_rl.py --rl-metrics-jsonl) reproduce a reference's step records?
Every value of the reference must be there and equal (==), except measurements of the machine
(`time/*`, `throughput/*`, `memory/*`, and the seconds environments took, `rollouts/env_seconds`:
`is_machine_measurement`); metrics the reference does not have (added since) are listed, not
compared. Exit status 1 and one line per difference otherwise.

  python tools/compare_metrics.py results/rl_tiny_h200.jsonl runs/tiny_sort/metrics.jsonl
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_rl_bi.reporting.metrics import is_machine_measurement, read_step_records  # noqa: E402


def differences(expected: dict[int, dict], actual: dict[int, dict]) -> list[str]:
    found = []
    if missing := sorted(set(expected) - set(actual)):
        found.append(f"steps of the reference missing here: {missing[:10]}")
    if extra := sorted(set(actual) - set(expected)):
        found.append(f"steps not in the reference: {extra[:10]}")
    for step in sorted(set(expected) & set(actual)):
        for key in sorted(k for k in expected[step] if not is_machine_measurement(k)):
            a, b = expected[step][key], actual[step].get(key, "<missing>")
            if a != b:
                found.append(f"step {step} {key}: {a!r} != {b!r}")
    return found


def added_metrics(expected: dict[int, dict], actual: dict[int, dict]) -> list[str]:
    return sorted({k for record in actual.values() for k in record}
                  - {k for record in expected.values() for k in record})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("expected", help="reference metrics JSONL")
    parser.add_argument("actual", help="metrics JSONL to check")
    args = parser.parse_args()
    try:
        expected, actual = read_step_records(args.expected), read_step_records(args.actual)
    except (OSError, ValueError) as exc:
        parser.error(str(exc))
    found = differences(expected, actual)
    print("\n".join(found) if found else f"every reference value reproduced: {args.actual}")
    if added := added_metrics(expected, actual):
        print(f"metrics not in the reference (not compared): {added}")
    sys.exit(1 if found else 0)


if __name__ == "__main__":
    main()
