r"""Every measured number in the README and docs/ comes from a file in results/: this tool writes
those numbers from the files, and checks that the text still says what the files do.

A number in the text sits in a region that names its file and where in the file it is:

  <!-- value results/bench_h200.json models.dense16.generation_ratio {:.2f}x -->1.13x<!-- /value -->
  <!-- table parity results/parity_dense_h200.json results/parity_hybrid_h200.json -->
  | model | mode | ... (the table, written by the tool)
  <!-- /table -->

An expression is a path into the file (`a.b.0.c`; `*` takes every item of a list or mapping,
`[i:j]` items i..j-1 of a list, `[key=value]` the items whose key equals value, `[key=a:b]` those
with a <= key <= b; a filter's key may be a path, `[shape.0=32]`),
optionally inside one of max, min, mean, median, sum, count. A JSONL metrics file reads as
{"steps": [its step records in step order], "runs": [its `run` headers]}. The format is
Python's (`{:.2f}x`, `{:.1%}`, `{:,}`), written without spaces.

  python tools/results_docs.py            # check: exit 1 and one line per drifted region
  python tools/results_docs.py --write    # rewrite every region from its files
"""

import argparse
import json
import os
import pathlib
import re
import statistics
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from megatron_rl_bi.jsonfile import read_object  # noqa: E402
from megatron_rl_bi.parity.doctor import ablation_entry  # noqa: E402
from megatron_rl_bi.reporting.metrics import read_segments  # noqa: E402
from megatron_rl_bi.reporting.provenance import stamped_commit  # noqa: E402

DOCS = ("README.md", "docs/*.md", "results/README.md")
VALUE = re.compile(r"<!-- value (\S+) (\S+) (\S+) -->(.*?)<!-- /value -->")
TABLE = re.compile(r"<!-- table (\w+)((?: \S+)*) -->\n(.*?)\n?<!-- /table -->", re.DOTALL)
AGGREGATES = {"max": max, "min": min, "mean": statistics.mean, "median": statistics.median, "sum": sum,
              "count": len}
SEGMENT = re.compile(r"\[(\d*):(\d*)\]|\[([^\]=]+)=([^\]]+)\]|([^.\[\]]+)")


def load(path: str) -> dict:
    """A result file as one mapping (see the module docstring for JSONL)."""
    full = REPO / path
    if not path.endswith(".jsonl"):
        return read_object(str(full))
    steps = {record["step"]: record for segment in read_segments(str(full)) for record in segment}
    with open(full) as f:
        runs = [json.loads(line)["run"] for line in f if line.startswith('{"run"')]
    return {"steps": [steps[s] for s in sorted(steps)], "runs": runs}


def _keeps(item, key: str, wanted: str) -> bool:
    """Whether `item` is kept by the filter [key=wanted]; `key` may be a dotted path."""
    value = item
    for part in key.split("."):
        value = value[int(part)] if isinstance(value, list) else value.get(part)
    if ":" in wanted and isinstance(value, int | float):
        low, high = (float(x) for x in wanted.split(":"))
        return low <= value <= high
    return str(value) == wanted


def evaluate(document: dict, expression: str):
    """The value of `expression` in `document` (KeyError, IndexError or ValueError if absent)."""
    aggregate = re.fullmatch(r"(\w+)\((.+)\)", expression)
    path = aggregate.group(2) if aggregate else expression
    node, many = document, False
    for start, stop, key, wanted, name in SEGMENT.findall(path):
        if start or stop:
            node, many = node[int(start or 0):int(stop) if stop else None], True
        elif name == "*":
            node, many = list(node.values()) if isinstance(node, dict) else list(node), True
        elif name:  # on a list, a name that is no index is taken from every item
            many = many or (isinstance(node, list) and not name.isdigit())
            pick = lambda item: item[int(name)] if isinstance(item, list) else item[name]  # noqa: E731
            node = [pick(item) for item in node] if many else pick(node)
        else:
            node, many = [item for item in node if _keeps(item, key, wanted)], True
    if aggregate:
        if aggregate.group(1) not in AGGREGATES:
            raise ValueError(f"unknown aggregate {aggregate.group(1)!r}")
        if not node:
            raise ValueError(f"{path} selects nothing")
        return AGGREGATES[aggregate.group(1)](node)
    return node


def render_value(path: str, expression: str, fmt: str) -> str:
    return fmt.format(evaluate(load(path), expression))


# ----------------------------------------------------------------------------- tables


def _parity_table(*paths: str) -> str:
    """Engine vs trainer logprobs of tools/check_parity.py reports, BI and default mode."""
    rows = ["| file | model | mode | abs_mean | max | tokens different (completion tokens) |",
            "| --- | --- | --- | --- | --- | --- |"]
    for path in paths:
        report = load(path)
        model = report["model"]
        name = (f"{'hybrid ' + model['hybrid_layer_pattern'] if model.get('hybrid_layer_pattern') else 'dense'}"
                f", {model['num_layers']} layers, hidden {model['hidden_size']}, {model['transformer_impl']}, "
                f"FA{model['flash_attention_version']}")
        for mode in ("bi", "default"):
            result = report[mode]
            completion = result.get("completion_only", result.get("generated_only"))
            rows.append(f"| `{os.path.basename(path)}` | {name} | {mode} | {result['abs_mean']:.2g} "
                        f"| {result['max']:.2g} | {result['ratio_tokens_different']:.1%} "
                        f"({completion['bit_wise/ratio_tokens_different']:.1%}) |")
    return "\n".join(rows)


def _rl_runs_table(*paths: str) -> str:
    """RL runs (pretrain_rl.py metrics): steps, parity, compared tokens, reward at the start and
    the end, step time and peak memory."""
    rows = ["| file | commit | steps | parity max, every step | tokens compared | reward, first / last 10 steps "
            "| step time, median | peak memory |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for path in paths:
        steps = load(path)["steps"]
        runs = load(path)["runs"]
        rewards = [r["reward/task_mean"] for r in steps]
        rows.append(
            f"| `{os.path.basename(path)}` | {stamped_commit(runs[0])[:7]} | {len(steps)} "
            f"| {max(r['bit_wise/logprob_diff/max'] for r in steps):g} "
            f"| {sum(r['bit_wise/tokens'] for r in steps):,} "
            f"| {statistics.mean(rewards[:10]):.2f} / {statistics.mean(rewards[-10:]):.2f} "
            f"| {statistics.median(r['time/step_s'] for r in steps):.2f} s "
            f"| {max(r['memory/peak_allocated_gib'] for r in steps):.1f} GiB |")
    return "\n".join(rows)


def _bench_table(*paths: str) -> str:
    """bench/suite.py reports, one table each (bench/suite.py --table)."""
    from bench.suite import markdown_table

    return "\n\n".join(f"`{os.path.basename(path)}`:\n\n" + markdown_table(load(path)) for path in paths)


def _decode_tail_table(*paths: str) -> str:
    """bench/decode_tail.py: host and GPU time of one call of each variant, at 32 requests."""
    rows = ["| file | vocabulary | variant | host µs | GPU µs |", "| --- | --- | --- | --- | --- |"]
    for path in paths:
        rows += [f"| `{os.path.basename(path)}` | {row['vocab']:,} | {row['variant']} | {row['host_us']:.0f} "
                 f"| {row['gpu_us']:.0f} |" for row in load(path)["rows"]]
    return "\n".join(rows)


def _gdn_rule_table(*paths: str) -> str:
    """bench/gdn_rule.py: one GDN layer's rule, forward and backward, in milliseconds."""
    names = {"recurrent_forward_ms": "fla recurrent forward (BI)", "fla_chunk_forward_ms": "fla chunked forward",
             "bi_step_torch_backward_ms": "BI step: recurrent forward + torch chunked backward",
             "bi_step_fla_backward_ms": "BI step: recurrent forward + fla chunked backward",
             "bi_step_auto_ms": "BI step: recurrent forward + the backward layers train with ('auto')",
             "fla_chunk_step_ms": "fla chunked forward + backward",
             "guard_lifted_bi_step_fla_backward_ms": "BI step: recurrent forward + fla's refused backward, refusal lifted",
             "guard_lifted_fla_chunk_step_ms": "fla chunked forward + its refused backward, refusal lifted",
             "torch_chunked_step_ms": "torch chunked forward + backward (megatron-core's deterministic rule)"}
    rows = ["| file | Triton | | ms |", "| --- | --- | --- | --- |"]
    for path in paths:
        report = load(path)
        rows += [f"| `{os.path.basename(path)}` | {report['versions']['triton']} | {names[key]} | {value:.1f} |"
                 for key, value in report["results"].items() if key in names]
    return "\n".join(rows)


def _memory_bench_table(*paths: str) -> str:
    """bench/memory.py: each piece of GPU memory measured, and what the planner predicted."""
    rows = ["| file | piece | measured GiB | planned GiB | planned / measured |", "| --- | --- | --- | --- | --- |"]
    for path in paths:
        rows += [f"| `{os.path.basename(path)}` | {row['component']} | {row['measured_gib']:.3f} "
                 f"| {row['planned_gib']:.3f} | {row['planned_over_measured']:.2f} |" for row in load(path)["rows"]]
    return "\n".join(rows)


def _memory_plan_table(*paths: str) -> str:
    """tools/memory_plan.py --plan-output: each plan's GPUs, its GPU pieces, the peaks of both
    phases, the engine's waves and the optimizer's host memory."""
    rows = ["| file | GPUs | weights | optimizer on the GPU | KV cache | peak generating | peak training "
            "| requests at once, waves | optimizer in host memory |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for path in paths:
        report = load(path)
        plan = report["plan_gib"]
        rows.append(f"| `{os.path.basename(path)}` | {report['gpus']} | {plan['weights']:.1f} | {plan['optimizer']:.1f} "
                    f"| {plan['KV cache + GDN states']:.1f} | {plan['peak_generation']:.1f} | {plan['peak_training']:.1f} "
                    f"| {plan['requests_at_once']}, {plan['generation_waves']} | {plan['host_optimizer']:.1f} |")
    return "\n".join(rows)


def _plan_vs_run_table(*paths: str) -> str:
    """RL runs: the memory plan in each run's header against the peaks its steps recorded: the
    run's, and each phase's where the steps record it (`memory/peak_{generation,training}_gib`)."""
    phases = (("generating", "peak_generation", "memory/peak_generation_gib"),
              ("training", "peak_training", "memory/peak_training_gib"),
              ("the run, its start included", "peak", "memory/peak_allocated_gib"))
    rows = ["| file | peak | planned GiB | measured GiB (max over steps) | planned / measured |",
            "| --- | --- | --- | --- | --- |"]
    for path in paths:
        report = load(path)
        plan = report["runs"][0]["memory_plan"]
        for name, planned_key, measured_key in phases:
            measured = [r[measured_key] for r in report["steps"] if measured_key in r]
            if measured:
                rows.append(f"| `{os.path.basename(path)}` | {name} | {plan[planned_key]:.1f} | {max(measured):.1f} "
                            f"| {plan[planned_key] / max(measured):.2f} |")
    return "\n".join(rows)


def _ablation_cell(row: dict) -> str:
    if "not_run" in row:
        return f"not run: {row['not_run'].split(' (')[0]}"
    first = f", first at `{row['first_differing']}`" if row["first_differing"] else ""
    return f"{row['tokens_different']:,} of {row['tokens']:,}, max {row['max_abs_diff']:.3g}{first}"


def _ablation_table(*paths: str) -> str:
    """The parity doctor's ablation (tools/parity_doctor.py --ablate), a column per file: for
    each BI piece left off alone, the logprob tokens that differ, the largest difference and the
    first component that differs; last, default mode (every piece off) as the doctor ran it."""
    reports = [load(path) for path in paths]
    rows = ["| piece off | " + " | ".join(f"`{os.path.basename(path)}`" for path in paths) + " |",
            "| --- |" + " --- |" * len(paths)]
    for piece in [row["piece"] for row in reports[0]["ablation"]]:
        cells = [_ablation_cell(next(row for row in report["ablation"] if row["piece"] == piece))
                 for report in reports]
        rows.append(f"| {piece} | " + " | ".join(cells) + " |")
    defaults = [_ablation_cell(ablation_entry("default", "every piece off", report["runs"]["default"]))
                for report in reports]
    rows.append("| default mode (all off) | " + " | ".join(defaults) + " |")
    return "\n".join(rows)


def _last_step_lines(path: str, plot: str) -> str:
    """The console's last lines of a pretrain_rl.py run: its last step's progress line, then
    the plot path tools/plot_metrics.py prints."""
    from megatron_rl_bi.reporting.metrics import MetricsLogger

    steps = load(path)["steps"]
    line = MetricsLogger(total_steps=steps[-1]["step"]).progress_line(steps[-1]["step"], steps[-1])
    return f"```\n{line}\ncurves: {plot}\n```"


TABLES = {"parity": _parity_table, "rl_runs": _rl_runs_table, "bench": _bench_table,
          "decode_tail": _decode_tail_table, "gdn_rule": _gdn_rule_table, "memory_bench": _memory_bench_table,
          "memory_plans": _memory_plan_table, "plan_vs_run": _plan_vs_run_table,
          "last_step_lines": _last_step_lines, "ablation": _ablation_table}


def render_table(name: str, *paths: str) -> str:
    if name not in TABLES:
        raise ValueError(f"unknown table {name!r} (known: {sorted(TABLES)})")
    return TABLES[name](*paths)


# ----------------------------------------------------------------------------- documents


def documents() -> list[pathlib.Path]:
    return sorted({path for pattern in DOCS for path in REPO.glob(pattern)})


def _line(text: str, offset: int) -> int:
    return text.count("\n", 0, offset) + 1


def regenerate(text: str, where: str) -> tuple[str, list[str], list[str]]:
    """`text` with every region written from its files; one line per region that differed, and
    one per region that could not be rendered (FILE:LINE: ...)."""
    problems, errors = [], []

    def value(match):
        try:
            wanted = render_value(*match.group(1, 2, 3))
        except (OSError, KeyError, IndexError, TypeError, ValueError) as exc:
            errors.append(f"{where}:{_line(text, match.start())}: {match.group(1)} {match.group(2)}: "
                            f"{type(exc).__name__}: {exc}")
            return match.group(0)
        if wanted != match.group(4):
            problems.append(f"{where}:{_line(text, match.start())}: {match.group(1)} {match.group(2)} is "
                            f"{wanted!r}, the text says {match.group(4)!r}")
        return match.group(0).replace(f"-->{match.group(4)}<!--", f"-->{wanted}<!--", 1)

    def table(match):
        try:
            wanted = render_table(match.group(1), *match.group(2).split())
        except (OSError, KeyError, IndexError, TypeError, ValueError) as exc:
            errors.append(f"{where}:{_line(text, match.start())}: table {match.group(1)}: "
                            f"{type(exc).__name__}: {exc}")
            return match.group(0)
        if wanted != match.group(3):
            problems.append(f"{where}:{_line(text, match.start())}: table {match.group(1)} differs from its files")
        return f"<!-- table {match.group(1)}{match.group(2)} -->\n{wanted}\n<!-- /table -->"

    return TABLE.sub(table, VALUE.sub(value, text)), problems, errors


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--write", action="store_true", help="rewrite the regions instead of checking them")
    return parser


def main() -> None:
    args = build_parser().parse_args()
    drifted, errors = [], []
    for path in documents():
        text = path.read_text()
        written, found, failed = regenerate(text, str(path.relative_to(REPO)))
        drifted, errors = drifted + found, errors + failed
        if args.write and written != text:
            path.write_text(written)
    shown = errors + ([] if args.write else drifted)
    print("\n".join(shown) if shown else f"every number matches its file ({len(documents())} documents)")
    sys.exit(1 if shown else 0)


if __name__ == "__main__":
    main()
