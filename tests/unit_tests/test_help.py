"""`--help` works for the entry points (megatron-core's help text has a bare '%'); pretrain_rl.py's
is this package's flags, with Megatron's behind --help-all, and no warning of megatron-core's
optional imports comes before a run's own output."""

import argparse
import os
import subprocess
import sys

import pytest

from megatron_rl_bi import compat

from .. import REPO


@pytest.mark.parametrize("script", ["pretrain_rl.py", "tools/check_parity.py", "tools/convert_hf.py"])
def test_help_exits_cleanly(script):
    argv = [sys.executable, os.path.join(REPO, script)]
    argv += ["verify", "--help"] if script.endswith("convert_hf.py") else ["--help"]
    result = subprocess.run(argv, capture_output=True, text=True, cwd=REPO, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "--batch-invariant-mode" in result.stdout


def test_convert_hf_help_and_the_flags_each_mode_needs():
    script = os.path.join(REPO, "tools", "convert_hf.py")
    result = subprocess.run([sys.executable, script, "--help"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and "python tools/convert_hf.py import" in result.stdout
    model = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "128",
             "--max-position-embeddings", "128"]
    result = subprocess.run([sys.executable, script, "export", *model],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode != 0
    assert "convert_hf.py: error: export needs --hf-checkpoint DIR" in result.stderr
    assert "--load RUN/checkpoints (the checkpoint exported)" in result.stderr
    assert "--save-hf OUT (the HF directory written)" in result.stderr


def test_upstream_help_still_breaks():
    """Pins the upstream bug the compat fix exists for; when this fails, remove the fix."""
    from megatron.training.arguments import add_megatron_arguments

    with pytest.raises(ValueError, match="unsupported format character"):
        add_megatron_arguments(argparse.ArgumentParser()).format_help()


def test_escape_keeps_argparse_placeholders():
    parser = argparse.ArgumentParser()
    parser.add_argument("--x", default=3, help="10% more, %(default)s by default, 50%% off")
    compat.escape_help_percent_signs(parser)
    assert "10% more, 3 by default, 50% off" in parser.format_help()


def _run(*flags) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, os.path.join(REPO, "pretrain_rl.py"), *flags], capture_output=True,
                          text=True, cwd=REPO, timeout=300)


def test_help_is_the_packages_flags_and_names_help_all():
    shown = _run("--help")
    assert shown.returncode == 0
    lines = shown.stdout.splitlines()
    assert lines[0] == "usage: pretrain_rl.py [--recipe YAML] [FLAG ...]" and len(lines) < 300
    for flag in ("--recipe", "--rl-env", "--hf-checkpoint", "--launch-check", "--batch-invariant-mode"):
        assert flag in shown.stdout, flag
    assert "--num-layers NUM_LAYERS" not in shown.stdout
    assert "python pretrain_rl.py --help-all" in " ".join(shown.stdout.split())  # as argparse wraps it
    assert "UserWarning" not in shown.stderr, shown.stderr


def test_help_all_is_every_flag():
    shown = _run("--help-all")
    assert shown.returncode == 0 and len(shown.stdout.splitlines()) > 1000
    assert "--num-layers NUM_LAYERS" in shown.stdout and "--rl-env" in shown.stdout
