import json

import pytest

from megatron_rl_bi.reporting.compiles import TritonCompiles
from megatron_rl_bi.reporting.metrics import MetricsLogger, header_flags, read_run_header, read_segments, read_step_records


def test_jsonl_has_a_run_header_and_step_records(tmp_path, capsys):
    path = tmp_path / "m.jsonl"
    logger = MetricsLogger(total_steps=2, jsonl_path=str(path), run_config={"lr": "0.1"},
                           run_info={"device": "cpu", "git_commit": "abc"})
    logger.log(1, {"reward/task_mean": 0.5, "loss": -0.1, "bit_wise/logprob_diff/max": 0.0})
    logger.close()
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert lines[0] == {"run": {"device": "cpu", "git_commit": "abc", "config": {"lr": "0.1"}}}
    assert lines[1]["step"] == 1 and lines[1]["reward/task_mean"] == 0.5
    assert "step 1/2 | reward 0.500 | loss -0.1000 | parity abs_mean nan max 0" in capsys.readouterr().out


def test_what_came_before_a_step_goes_into_its_record_alone(tmp_path):
    path = tmp_path / "m.jsonl"
    logger = MetricsLogger(total_steps=3, jsonl_path=str(path))
    logger.add_to_next_record({"time/startup_model_s": 4.0, "loss": 9.0})
    logger.add_to_next_record({"time/startup_sft_s": 2.0})
    logger.log(1, {"loss": -0.1})
    logger.log(2, {"loss": -0.2})
    logger.close()
    records = read_step_records(str(path))
    assert records[1] == {"step": 1, "time/startup_model_s": 4.0, "time/startup_sft_s": 2.0, "loss": -0.1}
    assert records[2] == {"step": 2, "loss": -0.2}


def test_each_record_carries_the_triton_compilations_since_the_record_before(tmp_path):
    path = tmp_path / "m.jsonl"
    compiles = TritonCompiles()
    logger = MetricsLogger(total_steps=2, jsonl_path=str(path), compiles=compiles)
    compiles.compiled, compiles.seconds, compiles.loaded = 3, 2.5, 4
    logger.log(1, {"loss": -0.1})
    compiles.compiled, compiles.seconds = 1, 0.5
    logger.log(2, {"loss": -0.2})
    logger.close()
    records = read_step_records(str(path))
    assert records[1] == {"step": 1, "time/triton_compiles": 3, "time/triton_compile_s": 2.5,
                          "time/triton_cache_loads": 4, "loss": -0.1}
    assert records[2] == {"step": 2, "time/triton_compiles": 1, "time/triton_compile_s": 0.5,
                          "time/triton_cache_loads": 0, "loss": -0.2}


def test_read_step_records_keeps_the_latest_record_of_a_step(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text('{"run": {}}\n{"step": 1, "x": 1}\n{"step": 2, "x": 2}\n{"run": {}}\n{"step": 2, "x": 3}\n')
    assert read_step_records(str(path)) == {1: {"step": 1, "x": 1}, 2: {"step": 2, "x": 3}}


def test_segments_are_the_records_of_each_process(tmp_path):
    """Each `run` header opens a segment: a resumed process's records are the second one, so a
    restart from step 1 and a resume at step 3 read differently even where the steps agree."""
    path = tmp_path / "m.jsonl"
    path.write_text('{"run": {}}\n{"step": 1}\n{"step": 2}\n{"run": {}}\n{"run": {}}\n{"step": 3}\n')
    assert read_segments(str(path)) == [[{"step": 1}, {"step": 2}], [{"step": 3}]]
    path.write_text('{"step": 1}\n{"run": {}}\n{"step": 1}\n')  # a file without its first header
    assert read_segments(str(path)) == [[{"step": 1}], [{"step": 1}]]


def test_compare_metrics_ignores_timings_only():
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[2] / "tools" / "compare_metrics.py"
    spec = importlib.util.spec_from_file_location("compare_metrics", path)
    compare = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(compare)
    expected = {1: {"loss": 0.5, "time/step_s": 1.0, "rollouts/env_seconds": 0.1, "memory/peak_allocated_gib": 4.0,
                    "throughput/tokens_per_s": 10.0}, 2: {"loss": 0.25}}
    assert compare.differences(expected, {1: {"loss": 0.5, "time/step_s": 9.0, "rollouts/env_seconds": 0.3,
                                              "memory/peak_allocated_gib": 4.5, "throughput/tokens_per_s": 9.0},
                                          2: {"loss": 0.25}}) == []
    assert compare.differences(expected, {1: {"loss": 0.5}, 2: {"loss": 0.2500001}}) == [
        "step 2 loss: 0.25 != 0.2500001"]
    assert compare.differences(expected, {1: {"loss": 0.5}}) == ["steps of the reference missing here: [2]"]
    assert compare.differences({1: {"loss": 0.5}}, expected) == ["steps not in the reference: [2]"]
    assert compare.differences({1: {"a": 1}}, {1: {"b": 1}}) == ["step 1 a: 1 != '<missing>'"]
    assert compare.added_metrics({1: {"a": 1}}, {1: {"a": 1, "b": 2}}) == ["b"]


def test_a_line_that_is_not_json_is_named_by_file_and_line(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text('{"step": 1}\n\n{"step": 2, "x"\n')
    with pytest.raises(ValueError, match=r"m.jsonl:3: not JSON"):
        read_step_records(str(path))


def test_a_pretty_printed_json_file_is_named_as_one_document_not_jsonl(tmp_path):
    """compare_metrics.py on a report (`json.dump(..., indent=2)`) said its first line was not
    JSON."""
    path = tmp_path / "report.json"
    path.write_text('{\n  "step": 1,\n  "loss": 0.5\n}\n')
    with pytest.raises(ValueError, match=r"report.json: one JSON document over several lines, not JSON Lines"):
        read_step_records(str(path))
    path.write_text('{\n  "step": 1,\n')  # neither: the bad line is named
    with pytest.raises(ValueError, match=r"report.json:1: not JSON"):
        read_step_records(str(path))


def test_a_record_whose_text_holds_unicode_line_separators_is_one_record(tmp_path):
    """JSON keeps U+2028 and a form feed raw in a string (ensure_ascii=False); a line is cut at
    newlines only."""
    path = tmp_path / "m.jsonl"
    path.write_text(json.dumps({"step": 1, "note": "a\u2028b\x0cc"}, ensure_ascii=False) + "\n", encoding="utf-8")
    assert read_step_records(str(path))[1]["note"] == "a\u2028b\x0cc"


def test_a_file_without_step_records_is_an_error(tmp_path):
    """An empty or header-only file compared as "every reference value reproduced" and plotted
    as empty axes."""
    path = tmp_path / "m.jsonl"
    path.write_text('{"run": {"git_commit": "abc"}}\n')
    with pytest.raises(ValueError, match=r"m.jsonl: no step records"):
        read_step_records(str(path))


def test_a_bi_run_whose_logprobs_differ_names_the_doctors_command_once(capsys):
    import math

    logger = MetricsLogger(total_steps=4, doctor_argv=["--recipe", "examples/recipes/tiny_sort.yaml",
                                                       "--rl-metrics-jsonl", "runs/a b.jsonl"])
    for step, largest in ((1, 0.0), (2, math.nan), (3, 0.25), (4, 0.5)):
        logger.log(step, {"bit_wise/logprob_diff/max": largest})
    lines = [line for line in capsys.readouterr().out.splitlines() if not line.startswith("step ")]
    assert lines == ["parity: bit_wise/logprob_diff/max 0.25 at step 3 in batch-invariant mode, where it is 0 "
                     "unless something differs between engine and trainer. Where they part, component by component:",
                     "  python tools/parity_doctor.py --recipe examples/recipes/tiny_sort.yaml --rl-metrics-jsonl "
                     "'runs/a b.jsonl' --parity-modes bi"]
    default_mode = MetricsLogger(total_steps=1)  # a default-mode run differs by design: no hint
    default_mode.log(1, {"bit_wise/logprob_diff/max": 0.5})
    assert "parity_doctor" not in capsys.readouterr().out


def test_a_run_headers_flags_come_back_with_their_types(tmp_path):
    """What pretrain_rl.py writes (every flag as str()) read back: literals typed, other strings as written."""
    flags = {"num_layers": 4, "bf16": True, "fp16": False, "num_experts": None, "rotary_percent": 0.5,
             "moe_layer_freq": [1, 0], "hybrid_layer_pattern": "G*G-", "moe_router_dtype": "fp32",
             "save": "runs/x", "lr": 1e-06}
    path = tmp_path / "metrics.jsonl"
    logger = MetricsLogger(total_steps=1, jsonl_path=str(path), run_config={k: str(v) for k, v in flags.items()},
                           run_info={"device": "cpu"})
    logger.log(1, {"loss": 0.5})
    logger.close()
    run = read_run_header(str(path))
    assert run["device"] == "cpu"
    assert vars(header_flags(run)) == flags


def test_a_file_without_a_run_header_has_no_flags(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps({"step": 1}) + "\n")
    with pytest.raises(ValueError, match="no run header"):
        read_run_header(str(path))
