r"""The benchmark of record: the three models of issue 10 through bench/profile_steps.py (BI and
default on the same weights, each run checking its own BI parity) and the GEMM table
(bench/gemm.py), gathered into one JSON with provenance and one PNG.

  python bench/suite.py --rounds 3 --output results/bench_h200.json \
      --extra-flags "--cuda-graph-impl local --inference-cuda-graph-scope block --decode-only-cuda-graphs \
                     --inference-dynamic-batching-async-sched-mode async"
  python bench/suite.py --table results/bench_h200.json    # the README's table, from the file
  python bench/suite.py --models qwen3_4b_long --skip-gemm --output results/bench_long_h200.json \
      --extra-flags "<the same>"                          # long responses: KV-bound decode

The record runs the engine with its decode CUDA graphs and async scheduling, as a user should;
without --extra-flags the engine is eager (results/bench_eager_h200.json). Each mode runs in a
process of its own, the second on the first's weights (a file in the work directory), so nothing
of the first mode's is left to the second's (in one process a MoE model's first mode kept
25 GiB past its end, and the second ran out of an H100's memory). --rounds N repeats each
model, alternating which mode runs first, and reports the medians: a decode step is host-bound,
and one process's host can run it slower than the next one's (results/README.md).
"""

import argparse
import itertools
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.report import positive_int, write_json  # noqa: E402
from megatron_rl_bi.jsonfile import read_object  # noqa: E402
from megatron_rl_bi.reporting.provenance import provenance  # noqa: E402

BENCH = os.path.dirname(os.path.abspath(__file__))
COMMON = ["--hidden-size", "2048", "--swiglu", "--untie-embeddings-and-output-weights",
          "--disable-bias-linear", "--bf16", "--seq-length", "1024", "--max-position-embeddings",
          "1024", "--micro-batch-size", "1", "--flash-attention-version", "4", "--seed", "1234",
          "--inference-max-seq-length", "1024"]
MODELS = {
    "dense4": ["--num-layers", "4", "--ffn-hidden-size", "5632", "--num-attention-heads", "16",
               "--group-query-attention", "--num-query-groups", "4", "--bench-vocab-size", "32000"],
    "dense16": ["--num-layers", "16", "--ffn-hidden-size", "6144", "--num-attention-heads", "16",
                "--group-query-attention", "--num-query-groups", "8", "--bench-vocab-size", "151936"],
    "hybrid24": ["--hybrid-layer-pattern", "G-G-G-*-" * 3, "--ffn-hidden-size", "6144",
                 "--num-attention-heads", "16", "--group-query-attention", "--num-query-groups", "4",
                 "--linear-num-key-heads", "16", "--linear-num-value-heads", "32",
                 "--linear-key-head-dim", "128", "--linear-value-head-dim", "128",
                 "--linear-conv-kernel-dim", "4", "--bench-vocab-size", "151936"],
    # Qwen3-4B's widths and depth decoding long responses, where the KV cache, not the weights,
    # is most of a step's bytes: 64 requests (the Qwen3 recipe's engine runs 64 at a time) at
    # contexts spread over 4K-8K tokens, as the recipe's second half of a response. The engine
    # alone: the trainer at this size is timed by the RL run (examples/rl_at_size.sh), and with it
    # and its CPU optimizer one run outlasted a device call (9 minutes, killed in its second mode).
    # Full recompute as the recipe: the parity check's trainer forward (autograd on, as the RL
    # step) of up to 16K tokens held 5.5 MB of activations a token without it, beside the cache,
    # and ran out of memory (4af7568). 128 new tokens: admitting the 64 prompts takes a step or
    # more each, and a decode step is measured only once all 64 are in and none has finished.
    "qwen3_4b_long": ["--num-layers", "36", "--hidden-size", "2560", "--ffn-hidden-size", "9728",
                      "--num-attention-heads", "32", "--group-query-attention", "--num-query-groups", "8",
                      "--kv-channels", "128", "--qk-layernorm", "--bench-vocab-size", "151936",
                      "--seq-length", "8192", "--max-position-embeddings", "8192",
                      "--inference-max-seq-length", "8192", "--inference-dynamic-batching-buffer-size-gb", "64",
                      "--bench-requests", "64", "--bench-prompt-tokens", "4096", "8064", "--bench-new-tokens", "128",
                      "--bench-generation-only",
                      "--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"],
    # Qwen3-30B-A3B's widths (128 experts, 8 a token, 768 wide; 32 heads, 4 KV groups) at 4 layers,
    # engine eager (MoE): BI's cost on a MoE model, the experts' many small GEMMs included.
    "moe_qwen3_30b_widths": ["--num-layers", "4", "--ffn-hidden-size", "6144", "--num-attention-heads", "32",
                             "--group-query-attention", "--num-query-groups", "4", "--kv-channels", "128",
                             "--qk-layernorm", "--num-experts", "128", "--moe-router-topk", "8",
                             "--moe-ffn-hidden-size", "768", "--bench-vocab-size", "151936"],
}
# The long decode at 32 requests and a cache for them: fits an H100 (80 GB), the machine lent most
# often. Its step reads about half the KV bytes of the H200's 64 requests, so its decode times and
# fraction of the roofline are its own, not set beside that record's.
MODELS["qwen3_4b_long_h100"] = MODELS["qwen3_4b_long"] + ["--bench-requests", "32",
                                                          "--inference-dynamic-batching-buffer-size-gb", "42"]
# dense16 at 128 requests, an RL step's request count: the decode step's bytes grow with the
# requests' KV cache while its host work does not.
MODELS["dense16_128r"] = MODELS["dense16"] + ["--bench-requests", "128",
                                              "--inference-dynamic-batching-max-requests", "128"]
RECORD = ("dense16", "dense4", "hybrid24")  # the benchmark of record; the others are outside it
# What a reader wants first, per model: ratios BI / default, and BI's decode step.
HEADLINE = {"dense16": "dense", "dense16_128r": "dense_128r", "hybrid24": "hybrid", "qwen3_4b_long": "long",
            "qwen3_4b_long_h100": "long_h100"}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument("--output", help="the JSON; the PNG goes beside it")
    target.add_argument("--table", help="print the Markdown table of an existing JSON; run nothing")
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=list(RECORD),
                        help="default: the record's three; qwen3_4b_long (results/bench_long_h200.json) "
                             "needs most of an H200, qwen3_4b_long_h100 (32 requests) fits an H100")
    parser.add_argument("--extra-flags", default="",
                        help="added to every model's flags, e.g. '--cuda-graph-impl local "
                             "--inference-cuda-graph-scope block --decode-only-cuda-graphs'")
    parser.add_argument("--rounds", type=positive_int, default=1,
                        help="runs of each model, BI first in even rounds and default first in odd ones; "
                             "the ratios and times are the rounds' medians")
    parser.add_argument("--skip-gemm", action="store_true",
                        help="leave out bench/gemm.py (its table does not depend on --extra-flags)")
    return parser


def _run(script: str, flags: list[str], output_flag: str, path: str) -> tuple[dict | None, str | None]:
    """Runs bench/`script` writing its JSON to `path`: (the JSON or None, what went wrong or None).
    A run that wrote no JSON, or JSON that does not parse, costs its own result, not the suite's."""
    code = subprocess.run([sys.executable, os.path.join(BENCH, script), *flags, output_flag, path]).returncode
    exit_status = f"exit {code}" if code else None
    if not os.path.exists(path):
        return None, f"exit {code}, wrote no {path}"
    try:
        return read_object(path), exit_status
    except ValueError as exc:
        return None, f"exit {code}, {exc}"


def profile_round(flags: list[str], index: int, workdir: str, name: str) -> tuple[dict | None, list[str]]:
    """One round of bench/profile_steps.py: each mode in a process of its own (BI first in even
    rounds), the second on the first's weights; the two reports in one (the first's provenance
    and config), or None when a mode wrote none; and what went wrong."""
    modes = ("bi", "default") if index % 2 == 0 else ("default", "bi")
    weights = os.path.join(workdir, f"{name}_{index}_weights.pt")
    reports, failures = {}, []
    for order, mode in enumerate(modes):
        passed = ["--bench-save-weights" if order == 0 else "--bench-weights", weights]
        report, failure = _run("profile_steps.py", flags + ["--bench-mode", mode, *passed], "--bench-output",
                               os.path.join(workdir, f"{name}_{index}_{mode}.json"))
        if failure:
            failures.append(f"{mode} mode: {failure}")
        if report is None or mode not in report:
            break
        reports[mode] = report
    if os.path.exists(weights):
        os.remove(weights)
    if len(reports) < 2:
        return None, failures
    return {**reports[modes[0]], "bi": reports["bi"]["bi"], "default": reports["default"]["default"]}, failures


def _ratio(bi: dict, default: dict, key: str) -> float | None:
    """BI / default of `key`; None where the bench did not measure it (--bench-generation-only)."""
    return bi[key] / default[key] if key in bi and key in default else None


def summarize(profile: dict) -> dict:
    bi, default = profile["bi"], profile["default"]
    return {
        "trainer_ratio": _ratio(bi, default, "train_fwd_bwd_s"),
        "update_ratio": _ratio(bi, default, "rl_update_s"),
        "generation_ratio": bi["generate_s"] / default["generate_s"],
        "decode_ms_bi": bi["decode_step_ms_median"],
        "decode_ms_default": default["decode_step_ms_median"],
        "decode_interval_ms_bi": bi.get("decode_interval_ms_median"),
        "decode_interval_ms_default": default.get("decode_interval_ms_median"),
        "decode_roofline_fraction_bi": bi["decode_hbm_roofline_fraction"],
        "decode_gb_per_step": bi["decode_bytes_per_step"] / 1e9,
        "decode_roofline_fraction_default": default["decode_hbm_roofline_fraction"],
        "hbm_copy_bytes_per_s_bi": bi["hbm_copy_bytes_per_s"],  # each mode's roofline, measured in its process
        "hbm_copy_bytes_per_s_default": default["hbm_copy_bytes_per_s"],
        "train_fwd_bwd_s": {"bi": bi.get("train_fwd_bwd_s"), "default": default.get("train_fwd_bwd_s")},
        "rl_update_s": {"bi": bi.get("rl_update_s"), "default": default.get("rl_update_s")},
        "generate_s": {"bi": bi["generate_s"], "default": default["generate_s"]},
        "engine_steps": {"bi": bi.get("engine_steps"), "default": default.get("engine_steps")},
        "engine_steps_unsynchronized": {"bi": bi.get("engine_steps_unsynchronized"),
                                        "default": default.get("engine_steps_unsynchronized")},
        "parity_max_bi": bi["parity_max"],
    }


def summarize_rounds(profiles: list[dict]) -> dict:
    """The rounds' summaries in one: each number, and each mode's raw time, is its median over the
    rounds (BI's parity its maximum); the step summaries are the first round's; each round's
    numbers are kept under "rounds"."""
    summaries = [summarize(profile) for profile in profiles]
    summary = dict(summaries[0])
    for key, first in summaries[0].items():
        values = [s[key] for s in summaries]
        if key == "parity_max_bi":
            summary[key] = max(values)
        elif isinstance(first, float | int):
            summary[key] = statistics.median(values)
        elif isinstance(first, dict) and all(isinstance(v, float | int) for v in first.values()):
            summary[key] = {mode: statistics.median(v[mode] for v in values) for mode in first}
    summary["rounds"] = [{k: v for k, v in s.items() if isinstance(v, float | int)} for s in summaries]
    return summary


def headline(models: dict) -> dict:
    """The keys issue 10 names: trainer_ratio_dense, ..., decode_ms_hybrid_bi, per model run."""
    keys = {}
    for name, short in HEADLINE.items():
        if name in models:
            m = models[name]
            keys.update({f"trainer_ratio_{short}": m["trainer_ratio"],
                         f"update_ratio_{short}": m["update_ratio"],
                         f"generation_ratio_{short}": m["generation_ratio"],
                         f"decode_ms_{short}_bi": m["decode_ms_bi"],
                         f"decode_interval_ms_{short}_bi": m.get("decode_interval_ms_bi"),
                         f"decode_roofline_fraction_{short}_bi": m["decode_roofline_fraction_bi"]})
    return keys


def markdown_table(report: dict) -> str:
    """Per model: the BI / default ratios, both decode steps (synchronized alone, and unsynchronized
    intervals where the file has them), BI's roofline fraction of each (the same bytes over the
    step's time and over the interval's: the interval's from the medians); the commit and extra
    flags the numbers came from, and the roofline's rate."""
    lines = ["| model | trainer fwd+bwd | RL update | generation | decode step BI / default "
             "| decode interval BI / default | bytes a decode step reads | BI decode, HBM roofline: step / interval |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, m in report["models"].items():
        interval, interval_roofline = "not measured", "not measured"
        if m.get("decode_interval_ms_bi") is not None:
            interval = f"{m['decode_interval_ms_bi']:.2f} / {m['decode_interval_ms_default']:.2f} ms"
            interval_roofline = f"{m['decode_roofline_fraction_bi'] * m['decode_ms_bi'] / m['decode_interval_ms_bi']:.1%}"
        step_bytes = f"{m['decode_gb_per_step']:.1f} GB" if "decode_gb_per_step" in m else "not recorded"
        trainer, update = (f"{m[key]:.2f}x" if m[key] is not None else "not measured"
                           for key in ("trainer_ratio", "update_ratio"))
        lines.append(f"| {name} | {trainer} | {update} "
                     f"| {m['generation_ratio']:.2f}x | {m['decode_ms_bi']:.2f} / {m['decode_ms_default']:.2f} ms "
                     f"| {interval} | {step_bytes} | {m['decode_roofline_fraction_bi']:.1%} / {interval_roofline} |")
    flags = report.get("extra_flags") or "none"
    rounds = report.get("rounds", 1)
    medians = f", medians of {rounds} rounds" if rounds > 1 else ""
    lines.append(f"\nBI time / default time, {report['device']}, commit {report['git_commit'][:7]}, "
                 f"extra flags: {flags}{medians}. {roofline_caption(report['models'])}")
    return "\n".join(lines)


def roofline_caption(models: dict) -> str:
    """What the roofline fractions are of: the copy rate BI mode measured on the device in the run
    (each model's median over its rounds), or in a file made before the runs measured it, the
    H200's rate bench/profile_steps.py then held as a constant."""
    rates = [f"{name} {m['hbm_copy_bytes_per_s_bi'] / 1e12:.2f} TB/s" for name, m in models.items()
             if "hbm_copy_bytes_per_s_bi" in m]
    if not rates:
        return "HBM roofline: an H200's copy rate, 4.3 TB/s (a constant before the runs measured their own)."
    return "HBM roofline: the copy rate measured in the run, " + ", ".join(rates) + "."


def plot(models: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(models)
    fig, (ratio_ax, decode_ax) = plt.subplots(1, 2, figsize=(10, 4))
    for offset, key in ((-0.2, "trainer_ratio"), (0.2, "generation_ratio")):
        ratios = [math.nan if models[n][key] is None else models[n][key] for n in names]  # nan: no bar
        ratio_ax.bar([i + offset for i in range(len(names))], ratios, width=0.4, label=key.replace("_", " "))
    ratio_ax.axhline(1.0, color="gray", linewidth=0.8)
    ratio_ax.set_xticks(range(len(names)), names)
    ratio_ax.set_ylabel("BI time / default time")
    ratio_ax.legend()
    bars = [("decode_ms", "step"), ("decode_interval_ms", "interval")]
    for offset, ((key, what), mode) in zip((-0.3, -0.1, 0.1, 0.3), itertools.product(bars, ("bi", "default"))):
        decode_ax.bar([i + offset for i in range(len(names))],
                      [models[n][f"{key}_{mode}"] for n in names], width=0.2, label=f"{what}, {mode}")
    decode_ax.set_xticks(range(len(names)), names)
    decode_ax.set_ylabel("decode (ms): step alone, interval")
    decode_ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def save_report_so_far(args, models: dict, profiles: dict, gemm: dict | None, failures: list[str]) -> dict:
    """Writes the report of what is measured so far (its "rounds": the fewest rounds of any model in it),
    so that a run stopped between rounds, or while writing, keeps the rounds it finished."""
    rounds = min((len(m["rounds"]) for m in models.values()), default=0)
    report = {**provenance(), "extra_flags": args.extra_flags, "rounds": rounds, "models": models,
              "gemm": gemm and gemm["shapes"], "profiles": profiles, "failures": failures}
    report.update(headline(models))
    write_json(report, args.output)
    return report


def main() -> None:
    args = build_parser().parse_args()
    if args.table:
        try:
            report = read_object(args.table)
        except (OSError, ValueError) as exc:  # missing, unreadable, or not one JSON object
            raise SystemExit(f"--table {args.table}: {exc}; expected a report of bench/suite.py --output") from None
        if "models" not in report:
            raise SystemExit(f"--table {args.table}: not a report of bench/suite.py (it has no 'models')")
        print(markdown_table(report))
        return
    failures, models, profiles, gemm = [], {}, {}, None
    with tempfile.TemporaryDirectory(prefix="bench_suite_") as workdir:  # each run's JSON, one round's weights
        for name in args.models:
            rounds = []
            for index in range(args.rounds):
                flags = COMMON + MODELS[name] + args.extra_flags.split()
                profile, failed = profile_round(flags, index, workdir, name)
                failures += [f"{name} round {index}: {failure}" for failure in failed]
                if profile is None:
                    break  # the next round would fail the same way (at 4af7568 all three ran out of memory)
                rounds.append(profile)
                profiles[name], models[name] = rounds[0], summarize_rounds(rounds)
                save_report_so_far(args, models, profiles, None, failures)
        if not args.skip_gemm:
            gemm, failure = _run("gemm.py", [], "--output", os.path.join(workdir, "gemm.json"))
            if failure:
                failures.append(f"gemm: {failure}")
    report = save_report_so_far(args, models, profiles, gemm, failures)
    if models:
        plot(models, os.path.splitext(args.output)[0] + ".png")
    print(json.dumps({k: v for k, v in report.items() if k not in ("profiles", "run")}, indent=2))
    if failures:
        raise SystemExit("failed: " + "; ".join(failures))


if __name__ == "__main__":
    main()
