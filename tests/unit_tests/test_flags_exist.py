"""Every `--flag` that the package, its tools, benches, examples or READMEs mention exists in
the parser of the program that takes it (a docstring or error message that names a flag the
user cannot pass is a defect)."""

import importlib.util
import re

from megatron_rl_bi.config import add_hf_args, add_rl_args, build_parser

from .. import REPO

SOURCES = [
    *sorted((REPO / "megatron_rl_bi").rglob("*.py")), *sorted((REPO / "tools").glob("*.py")),
    *sorted((REPO / "bench").glob("*.py")), *sorted((REPO / "examples").rglob("*.*")),
    REPO / "pretrain_rl.py", REPO / "README.md", REPO / "results" / "README.md", *sorted((REPO / "docs").glob("*.md")),
    REPO / "tests" / "conftest.py",
]
# A flag, not a prefix of one: `--rl-*`, `--inference-dynamic-batching-{...}` and `--no-...`
# are patterns in prose and are not matched.
FLAG = re.compile(r"(?<![\w-])--[a-z0-9]+(?:-[a-z0-9]+)*(?![\w{*-])")
# Flags of other programs that the examples and docs call.
OTHER_PROGRAMS = {
    "--help": "argparse",
    "--nproc-per-node": "torchrun", "--nnodes": "torchrun", "--rdzv-backend": "torchrun",
    "--rdzv-endpoint": "torchrun", "--rdzv-id": "torchrun", "--master-port": "torchrun", "--standalone": "torchrun",
    "--capture-range": "nsys", "--capture-range-end": "nsys",
    "--nodes": "sbatch", "--ntasks": "sbatch", "--ntasks-per-node": "sbatch",
    "--gpus-per-node": "sbatch", "--gpus": "sbatch", "--exclusive": "sbatch",
    "--job-name": "sbatch", "--time": "sbatch", "--requeue": "sbatch", "--kill-on-bad-exit": "srun",
    "--test-report": "pytest (tests/conftest.py)",
    "--porcelain": "git status", "--untracked-files": "git status", "--format": "git archive",
    "--show-toplevel": "git rev-parse", "--no-compile": "pip install (the device's staging)",
    **{flag: "bwrap (envs/sandbox.py)" for flag in (
        "--unshare-all", "--die-with-parent", "--new-session", "--cap-drop", "--clearenv", "--uid", "--gid",
        "--hostname", "--setenv", "--symlink", "--ro-bind", "--proc", "--dev", "--size", "--tmpfs", "--perms",
        "--file", "--remount-ro", "--chdir", "--dir")},
}


def _module(relative_path: str):
    spec = importlib.util.spec_from_file_location(relative_path, REPO / relative_path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _known_flags() -> set[str]:
    check_parity, bi_overhead = _module("tools/check_parity.py"), _module("bench/bi_overhead.py")

    def ours(parser):
        return bi_overhead.add_bench_args(check_parity.add_parity_args(add_hf_args(add_rl_args(parser))))

    parsers = [build_parser(ours), build_parser(_module("bench/profile_steps.py").add_profile_args),
               _module("bench/gdn_rule.py").build_parser(), _module("bench/gemm.py").build_parser(),
               _module("bench/decode_tail.py").build_parser(),
               _module("bench/suite.py").build_parser(), _module("bench/generation_floor.py").build_parser(),
               _module("tools/plot_metrics.py").build_parser(), _module("tools/source_hash.py").build_parser(),
               _module("tools/results_docs.py").build_parser(), _module("tools/memory_plan.py").build_parser(),
               _module("tools/memory_peak.py").build_parser(),
               _module("tools/random_hf_checkpoint.py").build_parser(),
               _module("tools/retrieval_server.py").build_parser(), _module("bench/memory.py").build_parser(),
               _module("bench/optimizer_offload.py").build_parser(), _module("tools/terminal_tasks.py").build_parser(),
               build_parser(_module("tools/parity_doctor.py").add_doctor_args)]
    return {flag for parser in parsers for action in parser._actions for flag in action.option_strings}


def mentioned_flags() -> dict[str, set[str]]:
    found = {}
    for path in SOURCES:
        for flag in FLAG.findall(path.read_text(encoding="utf-8")):
            found.setdefault(flag, set()).add(str(path.relative_to(REPO)))
    return found


def test_every_mentioned_flag_exists():
    known = _known_flags() | set(OTHER_PROGRAMS)
    missing = {flag: sorted(files) for flag, files in mentioned_flags().items() if flag not in known}
    assert not missing, f"flags mentioned but not accepted by any parser: {missing}"


def test_the_scan_finds_flags_and_skips_patterns():
    text = "use --rl-tis-cap or --grpo-clamp-eps-lower/upper, not --rl-* or --no-... or --a-{b,c}"
    assert FLAG.findall(text) == ["--rl-tis-cap", "--grpo-clamp-eps-lower"]
    assert "--rl-tis-cap" not in _known_flags()  # the flag this test was written for
