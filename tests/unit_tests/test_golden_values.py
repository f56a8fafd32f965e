"""The golden-value comparison (CPU): exact metrics must be equal at every step, the memory
median within 15%, step time reported and never a failure; a perturbed golden value fails; every
case file parses."""

import importlib.util
import json
import math
import os
import shutil

import pytest

from .. import REPO

_spec = importlib.util.spec_from_file_location("golden_values", os.path.join(REPO, "tools", "golden_values.py"))
golden_values = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(golden_values)

STEPS = [1, 2, 3]
STAMP = {"device": "NVIDIA H200", "git_commit": "0123abc", "source_hash": "f00d"}


def _records(**values) -> dict[int, dict]:
    """Every metric at steps 1..3: loss 0.1 * step, step time 1 + 0.05 * step, the rest fixed."""
    records = {s: {name: 0.0 for name in golden_values.METRICS} for s in STEPS}
    for s, record in records.items():
        record.update({"loss": 0.1 * s, "time/step_s": 1.0 + 0.05 * s, "memory/peak_allocated_gib": 10.0,
                       "rollouts/groups": 16, **values})
    return records


RECORDS = _records()


def _golden(records=RECORDS):
    return golden_values.golden_from_records(records, STEPS, STAMP)


def test_golden_file_format():
    golden = _golden()
    assert golden["loss"] == {"start_step": 1, "end_step": 3, "step_interval": 1,
                              "values": {"1": 0.1, "2": 0.2, "3": 0.30000000000000004}}
    assert set(golden) == {*golden_values.METRICS, "provenance"}  # rollouts/groups is neither
    assert golden["provenance"] == {**STAMP, "written_by": "tools/golden_values.py regenerate"}


def test_a_metric_missing_from_the_run_is_not_silently_dropped():
    records = _records()
    del records[2]["grad_norm"]
    with pytest.raises(ValueError, match="the run lacks grad_norm at step 2"):
        _golden(records)


def test_own_records_pass_and_a_perturbed_value_fails():
    golden = _golden()
    assert golden_values.compare(golden, RECORDS, STEPS) == []
    perturbed = math.nextafter(0.2, 1.0)  # one ulp
    golden["loss"]["values"]["2"] = perturbed
    assert golden_values.compare(golden, RECORDS, STEPS) == [f"loss step 2: 0.2 != golden {perturbed!r}"]


def test_an_empty_or_partial_golden_file_fails_naming_what_is_missing():
    everything = [f"{name}: the golden file has steps [], the case ['1', '2', '3']"
                  for name in golden_values.METRICS]
    assert golden_values.compare({}, RECORDS, STEPS) == ["the golden file has no provenance: regenerate it",
                                                         *everything]
    partial = _golden()
    del partial["grad_norm"]
    del partial["loss"]["values"]["3"]
    del partial["provenance"]
    assert golden_values.compare(partial, RECORDS, STEPS) == [
        "the golden file has no provenance: regenerate it",
        "loss: the golden file has steps ['1', '2'], the case ['1', '2', '3']",
        "grad_norm: the golden file has steps [], the case ['1', '2', '3']"]


def test_a_metric_missing_from_the_run_fails():
    records = _records()
    del records[3]["bit_wise/tokens"]
    assert golden_values.compare(_golden(), records, STEPS) == [
        "bit_wise/tokens: the run has no value at steps ['3']"]


def test_memory_within_15_percent_of_the_median_after_step_1():
    golden = _golden()
    more = {s: {**r, "memory/peak_allocated_gib": 11.4} for s, r in RECORDS.items()}
    more[1]["memory/peak_allocated_gib"] = 50.0  # step 1 (compilation) does not count
    assert golden_values.compare(golden, more, STEPS) == []
    much_more = {s: {**r, "memory/peak_allocated_gib": 11.6} for s, r in RECORDS.items()}
    assert golden_values.compare(golden, much_more, STEPS) == [
        "memory/peak_allocated_gib: median 11.6 vs golden 10 (+-15% or 0)"]


def test_step_time_is_reported_beside_the_golden_never_a_failure():
    golden = _golden()
    slower = {s: {**r, "time/step_s": r["time/step_s"] * 3} for s, r in RECORDS.items()}
    slower[1]["time/step_s"] = 100.0  # step 1 (compilation) does not count
    assert golden_values.compare(golden, slower, STEPS) == []
    assert golden_values.reported(golden, slower, STEPS) == [  # steps 2, 3: 1.1, 1.15 (x 3)
        "time/step_s: median 3.375 vs golden 1.125 (reported, not checked: a machine's measure)"]
    no_time = {s: {k: v for k, v in r.items() if k != "time/step_s"} for s, r in RECORDS.items()}
    assert golden_values.compare(golden, no_time, STEPS) == [
        "time/step_s: the run has no value at steps ['1', '2', '3']"]  # still written, still required


def test_one_step_that_compiles_does_not_move_the_median():
    steps = [1, 2, 3, 4, 5]
    records = {s: {**RECORDS[1], "memory/peak_allocated_gib": 10.0} for s in steps}
    golden = golden_values.golden_from_records(records, steps, STAMP)
    records[4] = {**records[4], "memory/peak_allocated_gib": 13.0}  # a new shape's buffers
    records[5] = {**records[5], "memory/peak_allocated_gib": 11.0}
    assert golden_values.compare(golden, records, steps) == []


def test_missing_steps_are_failures():
    failures = golden_values.compare(_golden(), {1: RECORDS[1], 2: RECORDS[2]}, STEPS)
    assert "loss: the run has no value at steps ['3']" in failures


def test_regenerate_refuses_a_bi_run_whose_parity_is_not_0(tmp_path):
    (tmp_path / "model_config.yaml").write_text(
        "MODEL_ARGS: {--train-iters: 3, --batch-invariant-mode: true}\n")
    case = golden_values.load_case(str(tmp_path))
    records = _records()
    records[2]["bit_wise/logprob_diff/max"] = 2.0 ** -20
    with pytest.raises(ValueError, match=r"BI parity is not 0, refusing .*: step 2: "
                                         r"bit_wise/logprob_diff/max = 9.5367431640625e-07"):
        golden_values.regenerate(case, records, STAMP)
    assert not (tmp_path / golden_values.GOLDEN).exists()
    golden_values.regenerate(case, RECORDS, STAMP)
    assert golden_values.compare(json.loads((tmp_path / golden_values.GOLDEN).read_text()), RECORDS, STEPS) == []


def _segments(*steps):
    return [[{"step": s} for s in segment] for segment in steps]


def test_a_resume_case_must_log_the_step_after_the_checkpoint_first(tmp_path):
    """A restarted run (nothing loaded) logs from step 1 again; under BI its later steps would
    still equal the golden values."""
    (tmp_path / "model_config.yaml").write_text("TEST_TYPE: ckpt-resume\nMODEL_ARGS: {--train-iters: 6}\n")
    case = golden_values.load_case(str(tmp_path))
    assert golden_values.case_steps(case) == [4, 5, 6]
    assert sorted(golden_values._resumed_records(case, _segments([1, 2, 3], [4, 5, 6]))) == [4, 5, 6]
    with pytest.raises(ValueError, match=r"logged steps \[\[1, 2, 3\], \[1, 2, 3, 4, 5, 6\]\]; "
                                         r"expected 3 steps, then 4..6"):
        golden_values._resumed_records(case, _segments([1, 2, 3], [1, 2, 3, 4, 5, 6]))


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


# The published run each case's exact values must equal (same recipe and flags, same bits).
# The published run of each case's recipe (a case without one is checked for provenance only).
PUBLISHED_RUN = {"gpt_tiny/bi_dense": "rl_tiny_h200.jsonl", "gpt_tiny/bi_resume": "rl_tiny_h200.jsonl",
                 "gpt_tiny/bi_dp2": "rl_tiny_dp2_h200.jsonl", "hybrid_tiny/bi_hybrid": "rl_tiny_hybrid_h200.jsonl",
                 "gpt_tiny/conversation_search": "rl_tiny_search_h200.jsonl",
                 "moe_tiny/moe_bi": "rl_tiny_moe_h200.jsonl"}


@pytest.mark.parametrize("path", golden_values.all_cases(), ids=lambda p: os.path.relpath(p, golden_values.CASES))
def test_golden_files_carry_provenance_and_the_published_runs_values(path):
    """A golden file says which run wrote it (a commit the run read from its tree, or one declared
    for a file written before stamps, then backed by the published run's own stamp), and its exact
    values are those of the published run of the same recipe: the bits reproduced. (Time and
    memory are not compared here: two runs' timings are not the claim.)"""
    from megatron_rl_bi.reporting.metrics import read_step_records
    from megatron_rl_bi.reporting.provenance import read_stamps, stamped_commit

    name = os.path.relpath(path, golden_values.CASES)
    golden = golden_values.read_object(os.path.join(path, golden_values.GOLDEN))
    provenance = golden["provenance"]
    if name not in PUBLISHED_RUN:
        assert len(stamped_commit(provenance)) == 40 and len(provenance["source_hash"]) == 64
        return
    published = os.path.join(REPO, "results", PUBLISHED_RUN[name])
    if "same_values_as" in provenance:  # written before golden files carried provenance
        assert provenance["same_values_as"] == os.path.relpath(published, REPO)
        assert [stamped_commit(s) for s in read_stamps(published)] == [provenance["declared_commit"]]
    else:  # the run's own stamp (tests/unit_tests/test_provenance.py checks its source hash)
        assert len(stamped_commit(provenance)) == 40 and len(provenance["source_hash"]) == 64
    records = read_step_records(published)
    steps = golden_values.case_steps(golden_values.load_case(path))
    for metric in golden_values.EXACT:
        assert sorted(golden[metric]["values"], key=int) == [str(s) for s in steps], metric
        assert {s: golden[metric]["values"][str(s)] for s in steps} == {s: records[s][metric] for s in steps}


def test_a_resume_case_stops_half_way_then_resumes_with_another_seed(tmp_path, monkeypatch):
    """The second process must start from the checkpoint and with RESUME_SEED: only a restored
    run can then repeat the golden values (with the run's own seed a restart could too)."""
    case = golden_values.Case(str(tmp_path), {"--train-iters": 4, "--seed": 7}, {}, "ckpt-resume")
    calls = []

    def pretrain_rl(case, extra):
        calls.append(extra)
        metrics = extra[extra.index("--rl-metrics-jsonl") + 1]
        steps = (1, 2) if "--exit-interval" in extra else (3, 4)
        with open(metrics, "a") as f:
            f.write(json.dumps({"run": STAMP}) + "\n")
            f.writelines(json.dumps({"step": s, "loss": 0.1 * s}) + "\n" for s in steps)

    monkeypatch.setattr(golden_values, "_pretrain_rl", pretrain_rl)
    records, _ = golden_values.run_case(case, str(tmp_path), checking=True)
    checkpoints = str(tmp_path / "ckpt")
    assert calls[0][-2:] == ["--exit-interval", "2"] and "--load" not in calls[0]
    assert calls[1][-4:] == ["--load", checkpoints, "--seed", str(golden_values.RESUME_SEED)]
    assert golden_values.RESUME_SEED != 7 and sorted(records) == [3, 4]


class _Ran(Exception):
    pass


def _flags_of_run(monkeypatch, case, checking) -> list[str]:
    """The flags run_case gives pretrain_rl (the run itself stopped there)."""
    def stop(case, extra):
        raise _Ran(extra)
    monkeypatch.setattr(golden_values, "_pretrain_rl", stop)
    with pytest.raises(_Ran) as ran:
        golden_values.run_case(case, "/tmp/w", checking)
    return ran.value.args[0]


def test_a_replay_environment_case_records_to_regenerate_and_plays_back_to_check(tmp_path, monkeypatch):
    (tmp_path / "model_config.yaml").write_text("REPLAY_ENVIRONMENT: true\nMODEL_ARGS: {--train-iters: 2}\n")
    case = golden_values.load_case(str(tmp_path))
    recording = str(tmp_path / golden_values.RECORDING)
    with pytest.raises(SystemExit, match=f"{recording}: missing \\(REPLAY_ENVIRONMENT\\)"):
        (tmp_path / golden_values.GOLDEN).write_text("{}")
        golden_values._load_all([str(tmp_path)], "check")
    (tmp_path / golden_values.RECORDING).write_text("old")
    assert _flags_of_run(monkeypatch, case, checking=True)[-2:] == ["--rl-env-replay", recording]
    assert os.path.exists(recording)
    assert _flags_of_run(monkeypatch, case, checking=False)[-2:] == ["--rl-env-record", recording]
    assert not os.path.exists(recording)  # --rl-env-record appends: the old recording went first
    (tmp_path / "model_config.yaml").write_text("MODEL_ARGS: {--train-iters: 2}\n")
    assert "--rl-env-record" not in _flags_of_run(monkeypatch, golden_values.load_case(str(tmp_path)), False)
    (tmp_path / "model_config.yaml").write_text("REPLAY_ENVIRONMENT: yes please\nMODEL_ARGS: {--train-iters: 2}\n")
    with pytest.raises(ValueError, match="REPLAY_ENVIRONMENT 'yes please': expected true or false"):
        golden_values.load_case(str(tmp_path))


def _golden_run(golden: dict, calls: list):
    """A stand-in for pretrain_rl that logs `golden`'s values: the steps the process would run
    (a stopped process up to --exit-interval, a resumed one after it), each golden metric at its
    step (1.0 where the golden file has no value: the stopped half). Each call's flags go to `calls`."""
    def pretrain_rl(case, extra):
        calls.append(extra)
        steps = int(case.model_args["--train-iters"])
        first, last = 1, steps
        if "--exit-interval" in extra:
            last = int(extra[extra.index("--exit-interval") + 1])
        elif "--load" in extra:
            first = steps // 2 + 1
        metrics = extra[extra.index("--rl-metrics-jsonl") + 1]
        with open(metrics, "a") as f:
            f.write(json.dumps({"run": STAMP}) + "\n")
            for step in range(first, last + 1):
                values = {name: golden[name]["values"].get(str(step), 1.0) for name in golden_values.METRICS}
                f.write(json.dumps({"step": step, **values}) + "\n")
    return pretrain_rl


@pytest.mark.parametrize("path", golden_values.all_cases(), ids=lambda p: os.path.relpath(p, golden_values.CASES))
def test_the_gpu_tests_own_body_runs_each_case_as_the_tool_checks_it(path, tmp_path, monkeypatch):
    """tests/functional_tests/test_golden_values.py on the CPU, pretrain_rl replaced by a run
    that logs the case's golden values: the GPU test's calls into the tool stay in step with it
    (it called run_case with a keyword the tool had renamed, and every case failed at the call,
    unseen until a GPU ran it)."""
    from tests.functional_tests import test_golden_values as gpu_test

    case_dir = str(shutil.copytree(path, tmp_path / "case"))  # a recording run removes the case's recording
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    with open(os.path.join(case_dir, golden_values.GOLDEN)) as f:
        golden = json.load(f)
    tested, checked = [], []
    monkeypatch.setattr(gpu_test.golden_values, "_pretrain_rl", _golden_run(golden, tested))
    monkeypatch.setattr(gpu_test.torch.cuda, "device_count", lambda: 8)
    gpu_test.test_case_matches_its_golden_values(case_dir, run_dir)
    # the runs it made are those `golden_values.py check` makes (a resume case's two among them)
    os.remove(run_dir / "m.jsonl")
    monkeypatch.setattr(golden_values, "_pretrain_rl", _golden_run(golden, checked))
    golden_values.run_case(golden_values.load_case(case_dir), str(run_dir), checking=True)
    assert tested == checked
