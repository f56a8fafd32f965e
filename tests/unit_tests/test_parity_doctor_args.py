"""tools/parity_doctor.py's inputs, before any GPU work: a run's own flags work as they are (the
request lengths fitted to the model), what the doctor cannot diagnose is named by its flag, the
engine is made eager, and the ablation runs each piece its model has."""

import importlib.util

import pytest

from .. import REPO

_spec = importlib.util.spec_from_file_location("parity_doctor", REPO / "tools" / "parity_doctor.py")
doctor = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(doctor)

RUN = ["--recipe", str(REPO / "examples/recipes/tiny_sort.yaml"), "--batch-invariant-mode",
       "--flash-attention-version", "4"]
HYBRID = ["--recipe", str(REPO / "examples/recipes/tiny_sort_hybrid.yaml"), "--batch-invariant-mode",
          "--flash-attention-version", "4"]


def test_a_runs_flags_work_as_they_are():
    args, vocab_size, hf_model = doctor.read_inputs(RUN + ["--json", "/tmp/doctor.json"])
    assert args.parity_requests == 8 and args.parity_output == "/tmp/doctor.json" and hf_model is None
    # tiny_sort's 64 positions: prompts of up to 32 tokens, budgets of up to 32
    assert args.parity_prompt_lengths == [1, 32] and args.parity_max_new_tokens == [1, 32]
    assert vocab_size >= 1
    given, _, _ = doctor.read_inputs(RUN + ["--parity-prompt-lengths", "2", "9"])
    assert given.parity_prompt_lengths == [2, 9] and given.parity_max_new_tokens == [1, 55]


def test_what_the_doctor_cannot_diagnose_is_named(monkeypatch):
    args, _, _ = doctor.read_inputs(RUN + ["--ablate"])
    args.tensor_model_parallel_size, args.expert_model_parallel_size = 2, 4
    assert doctor.doctor_problems(args) == ["--tensor-model-parallel-size 2: the doctor runs one GPU",
                                            "--expert-model-parallel-size 4: the doctor runs one GPU"]


def test_the_engine_runs_eagerly_and_says_so(capsys):
    args, _, _ = doctor.read_inputs(RUN)
    args.cuda_graph_impl = "local"
    doctor.run_engine_eagerly(args)
    assert args.cuda_graph_impl == "none" and args.inference_dynamic_batching_async_sched_mode == "legacy"
    assert capsys.readouterr().out.count("[doctor] running with") == 1  # legacy was already the mode


@pytest.mark.parametrize("flags, skipped", [(RUN, {"gdn_recurrent", "te_norm"}), (HYBRID, {"te_norm"})])
def test_the_ablation_runs_each_piece_the_model_has(flags, skipped, monkeypatch):
    monkeypatch.setattr(doctor, "flash_varlen_function", lambda version: object())  # both installed
    args, _, _ = doctor.read_inputs(flags + ["--ablate", "--parity-modes", "default", "--transformer-impl", "local"])
    runs = doctor.runs_of(args)
    assert runs[:2] == [("default", False, ()), ("bi", True, ())]
    assert {without for _, _, (without,) in runs[2:]} == set(doctor.bi.PIECES) - skipped
    assert all(on for _, on, _ in runs[1:])


def test_a_missing_flash_attention_generation_is_not_run_with_its_reason(monkeypatch):
    def only_four(version):
        if version != 4:
            raise ImportError(f"FlashAttention-{version} is absent")
    monkeypatch.setattr(doctor, "flash_varlen_function", only_four)
    args, _, _ = doctor.read_inputs(RUN)
    assert doctor.piece_problem(args, "flash_version") == "FlashAttention-3 is not installed (FlashAttention-3 is absent)"
    assert doctor.piece_problem(args, "gemm") is None


def test_te_norms_are_ablated_only_where_the_model_has_them():
    args, _, _ = doctor.read_inputs(RUN + ["--transformer-impl", "local"])
    assert doctor.piece_problem(args, "te_norm") == "--transformer-impl local: no TE norms"
    args.transformer_impl = "transformer_engine"
    assert doctor.piece_problem(args, "te_norm") is None
