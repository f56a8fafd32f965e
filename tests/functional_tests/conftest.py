import os
import subprocess
import sys
import tempfile

from .. import REPO

TINY_RECIPE = os.path.join(REPO, "examples", "recipes", "tiny_sort.yaml")
# Small enough for a functional test; everything else from the README's main-job recipe.
QUICK = ["--rl-sft-warmup-steps", "20", "--grpo-prompts-per-step", "4", "--save-interval", "1000"]


def run_pretrain_rl(*flags: str, nproc: int = 1) -> None:
    """pretrain_rl.py with the tiny recipe; checkpoints go to a temporary directory unless the
    flags name one (never into the recipe's runs/ directory, which is the user's)."""
    if "--save" not in flags:
        flags = (*flags, "--save", tempfile.mkdtemp(prefix="megatron_rl_bi_test_"))
    if nproc == 1:
        command = [sys.executable, os.path.join(REPO, "pretrain_rl.py")]
    else:
        command = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
                   os.path.join(REPO, "pretrain_rl.py")]
    subprocess.run(command + ["--recipe", TINY_RECIPE, *QUICK, *flags], check=True, cwd=REPO)


def read_metrics(path) -> dict[int, dict]:
    from megatron_rl_bi.reporting.metrics import read_step_records

    return read_step_records(str(path))
