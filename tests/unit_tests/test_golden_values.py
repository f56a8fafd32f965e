"""The golden-value comparison (CPU): exact metrics must be equal at every step, timing and memory
medians within 15% (step time also within 0.15 s); a perturbed golden value fails; every case
file parses."""

import importlib.util
import math
import os

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_spec = importlib.util.spec_from_file_location("golden_values", os.path.join(REPO, "tools", "golden_values.py"))
golden_values = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(golden_values)

RECORDS = {s: {"loss": 0.1 * s, "bit_wise/logprob_diff/max": 0.0, "time/step_s": 1.0 + 0.05 * s,
               "memory/peak_allocated_gib": 10.0, "rollouts/groups": 16} for s in (1, 2, 3)}


def test_golden_file_format():
    golden = golden_values.golden_from_records(RECORDS)
    assert golden["loss"] == {"start_step": 1, "end_step": 3, "step_interval": 1,
                              "values": {"1": 0.1, "2": 0.2, "3": 0.30000000000000004}}
    assert "rollouts/groups" not in golden  # neither exact nor approximate: not recorded


def test_own_records_pass_and_a_perturbed_value_fails():
    golden = golden_values.golden_from_records(RECORDS)
    assert golden_values.compare(golden, RECORDS) == []
    perturbed = math.nextafter(0.2, 1.0)  # one ulp
    golden["loss"]["values"]["2"] = perturbed
    assert golden_values.compare(golden, RECORDS) == [f"loss step 2: 0.2 != golden {perturbed!r}"]


def test_time_and_memory_within_15_percent_of_the_median_after_step_1():
    golden = golden_values.golden_from_records(RECORDS)
    slower = {s: {**r, "time/step_s": r["time/step_s"] * 1.1} for s, r in RECORDS.items()}
    slower[1]["time/step_s"] = 100.0  # step 1 (compilation) does not count
    assert golden_values.compare(golden, slower) == []
    much_slower = {s: {**r, "time/step_s": r["time/step_s"] * 1.2} for s, r in RECORDS.items()}
    assert golden_values.compare(golden, much_slower) == [
        "time/step_s: median 1.35 vs golden 1.125 (+-15% or 0.15)"]  # steps 2, 3: 1.1, 1.15 (x 1.2)


def test_short_steps_pass_within_the_absolute_time_floor_only():
    records = {s: {"time/step_s": 0.25, "memory/peak_allocated_gib": 4.0} for s in range(1, 4)}
    golden = golden_values.golden_from_records(records)
    host_jitter = {s: {"time/step_s": 0.39, "memory/peak_allocated_gib": 4.0} for s in records}
    assert golden_values.compare(golden, host_jitter) == []  # +56%, but only 0.14 s
    slower = {s: {"time/step_s": 0.41, "memory/peak_allocated_gib": 4.0} for s in records}
    assert golden_values.compare(golden, slower) == ["time/step_s: median 0.41 vs golden 0.25 (+-15% or 0.15)"]
    more_memory = {s: {"time/step_s": 0.25, "memory/peak_allocated_gib": 4.7} for s in records}
    assert golden_values.compare(golden, more_memory) == [
        "memory/peak_allocated_gib: median 4.7 vs golden 4 (+-15% or 0)"]  # no floor for memory


def test_one_step_that_compiles_does_not_move_the_median():
    records = {s: {"time/step_s": 1.0} for s in range(1, 6)}
    golden = golden_values.golden_from_records(records)
    records[4] = {"time/step_s": 3.6}  # a kernel compiled for a new shape
    assert golden_values.compare(golden, records) == []


def test_missing_steps_are_failures():
    golden = golden_values.golden_from_records(RECORDS)
    assert "loss: no value at steps ['3']" in golden_values.compare(golden, {1: RECORDS[1], 2: RECORDS[2]})


@pytest.mark.parametrize("path", golden_values.all_cases())
def test_cases_parse(path):
    case = golden_values.load_case(path)
    assert case.test_type in ("regular", "ckpt-resume")
    assert "--train-iters" in case.model_args and "--batch-invariant-mode" in case.flags()


def test_check_reads_every_case_and_golden_file_before_running(tmp_path):
    """_load_all runs before any case does: a missing golden file or case is named first."""
    case = tmp_path / "model" / "case"
    case.mkdir(parents=True)
    (case / "model_config.yaml").write_text("MODEL_ARGS: {--train-iters: 2}\n")
    with pytest.raises(SystemExit, match=f"{case}/golden_values_dev_h200.json: missing"):
        golden_values._load_all([golden_values.all_cases()[0], str(case)], "check")
    with pytest.raises(SystemExit, match=f"{tmp_path}: no model_config.yaml"):
        golden_values._load_all([str(tmp_path)], "regenerate")
    assert [c.path for c, golden in golden_values._load_all([str(case)], "regenerate")] == [str(case)]


def test_a_golden_file_that_is_not_json_is_named_with_its_line(tmp_path):
    case = tmp_path / "model" / "case"
    case.mkdir(parents=True)
    (case / "model_config.yaml").write_text("MODEL_ARGS: {--train-iters: 2}\n")
    (case / "golden_values_dev_h200.json").write_text('{"loss": {\n  "1": 0.5,\n}\n')
    with pytest.raises(ValueError, match=f"{case}/golden_values_dev_h200.json:3: not JSON"):
        golden_values._load_all([str(case)], "check")


@pytest.mark.parametrize("text, problem", [
    ("TEST_TYPE: regular\n", "expected a mapping with MODEL_ARGS"),
    ("", "expected a mapping with MODEL_ARGS"),
    ("MODEL_ARGS: {--recipe: examples/recipes/tiny_sort.yaml}\n", "MODEL_ARGS --train-iters None"),
    ("MODEL_ARGS: {--train-iters: '4'}\n", "MODEL_ARGS --train-iters '4'"),
    ("TEST_TYPE: ckpt-resume\nMODEL_ARGS: {--train-iters: 1}\n", "MODEL_ARGS --train-iters 1"),
])
def test_a_case_without_its_step_count_is_refused_when_read(tmp_path, text, problem):
    """Read for every case before any runs: a case that lacked --train-iters failed in its own run,
    after the cases before it had used the GPU."""
    (tmp_path / "model_config.yaml").write_text(text)
    with pytest.raises(ValueError, match=f"{tmp_path}/model_config.yaml: {problem}"):
        golden_values.load_case(str(tmp_path))
