"""examples/parity_doctor.sh runs the doctor with flags it takes, for either model, and stops on
a model it does not know before any work (run in a copy with `python` stubbed)."""

import shlex

import pytest

from .example_scripts import run_stubbed
from .test_parity_doctor_args import doctor


@pytest.mark.parametrize("model, pattern", [("dense", None), ("hybrid", "G")])
def test_the_doctors_flags_are_its_own(tmp_path, monkeypatch, model, pattern):
    done, calls = run_stubbed(tmp_path, "parity_doctor.sh", model, "--seed", "7")
    assert done.returncode == 0, done.stderr
    (call,) = calls
    program, *flags = shlex.split(call)[1:]
    assert program == "tools/parity_doctor.py" and flags[-2:] == ["--seed", "7"]
    assert flags[flags.index("--json") + 1] == f"runs/parity_doctor_{model}.json"
    monkeypatch.chdir(tmp_path)  # where the script ran: its recipes, its output directory
    args, _, _ = doctor.read_inputs(flags)
    assert args.ablate and args.parity_modes == ["bi", "default"] and args.seed == 7
    assert (pattern in args.hybrid_layer_pattern) if pattern else args.hidden_size == 2048
    assert args.parity_prompt_lengths == [1, 128] and args.parity_max_new_tokens == [1, 64]


def test_an_output_path_and_an_unknown_model(tmp_path):
    done, calls = run_stubbed(tmp_path / "out", "parity_doctor.sh", "hybrid", "results/x.json")
    assert done.returncode == 0 and "--json results/x.json" in calls[0]
    done, calls = run_stubbed(tmp_path / "bad", "parity_doctor.sh", "moe")
    assert done.returncode == 2 and "MODEL must be dense or hybrid, got 'moe'" in done.stderr and calls == []
