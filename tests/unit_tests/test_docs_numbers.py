"""Every measured number in the README and docs/ comes from a file in results/ (CPU): each one
sits in a region that names its file and key, and says what the file says
(tools/results_docs.py); no number with a unit of measure stands outside such a region; and
results/README.md names, for every file, the commit stamped in it."""

import importlib.util
import json
import os
import re
import sys

import pytest

from megatron_rl_bi.reporting.provenance import read_stamps, stamped_commit

from .. import REPO

_spec = importlib.util.spec_from_file_location("results_docs", REPO / "tools" / "results_docs.py")
results_docs = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(results_docs)

DOCUMENTS = results_docs.documents()
# A measurement: a number with a unit of time, size, rate or ratio, or in scientific notation
# (with a point or a negative exponent: a commit such as 7e07206 is none).
MEASURED = re.compile(r"(?<![\w.-])(?:\d[\d,]*(?:\.\d+)?(?:\s?(?:ms|µs|us|ns|s|min|GiB|MiB|GB|MB|KB|TB/s|GB/s|"
                      r"TFLOP/s|tokens/s|tok/s)|%|x)(?![\w/])|\d\.\d+e-?\d+\b|\de-\d+\b)")
# Where a number is not a claim: code blocks and spans (commands, flags, code values) and regions.
NOT_PROSE = re.compile(r"```.*?```|`[^`\n]*`|<!-- value .*?<!-- /value -->|<!-- table .*?<!-- /table -->",
                       re.DOTALL)


def _name(path):
    return str(path.relative_to(REPO))


@pytest.mark.parametrize("path", DOCUMENTS, ids=_name)
def test_every_number_matches_its_file(path):
    text = path.read_text()
    written, drifted, errors = results_docs.regenerate(text, _name(path))
    assert errors == [] and drifted == [], "\n".join(errors + drifted)
    assert written == text


@pytest.mark.parametrize("path", DOCUMENTS, ids=_name)
def test_no_measured_number_outside_a_region(path):
    text = path.read_text()
    prose = NOT_PROSE.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), text)
    found = [f"{_name(path)}:{prose.count(chr(10), 0, m.start()) + 1}: {m.group(0)!r}"
             for m in MEASURED.finditer(prose)]
    assert not found, "numbers without a file (put them in a value region):\n" + "\n".join(found)


def test_the_scan_and_the_check_see_what_they_must(tmp_path):
    prose = "It took 3.9 s, 12% more, 1.13x the time, 4.65e-2 off; 8 prompts x 16 samples, 120 steps."
    assert [m.group(0) for m in MEASURED.finditer(prose)] == ["3.9 s", "12%", "1.13x", "4.65e-2"]
    region = ("<!-- value results/bench_h200.json models.dense16.generation_ratio {:.2f}x -->"
              "{}<!-- /value -->")
    right = region.replace("{}<!--", results_docs.render_value(
        "results/bench_h200.json", "models.dense16.generation_ratio", "{:.2f}x") + "<!--")
    assert results_docs.regenerate(right, "doc")[1:] == ([], [])
    wrong = region.replace("{}<!--", "9.99x<!--")
    written, drifted, errors = results_docs.regenerate(wrong, "doc")
    assert errors == [] and len(drifted) == 1 and "the text says '9.99x'" in drifted[0]
    assert written == right
    missing = region.replace("generation_ratio", "no_such_key").replace("{}<!--", "1<!--")
    assert "KeyError" in results_docs.regenerate(missing, "doc")[2][0]


def test_expressions():
    document = {"steps": [{"step": s, "r": s / 10, "m": {"k": [s, 2 * s]}} for s in range(1, 6)],
                "rows": [{"shape": [32, 8], "t": 1.0}, {"shape": [64, 8], "t": 3.0}, {"shape": [32, 4], "t": 5.0}]}
    assert results_docs.evaluate(document, "mean(steps[step=2:3].r)") == 0.25
    assert results_docs.evaluate(document, "max(steps.m.k.1)") == 10
    assert results_docs.evaluate(document, "steps.0.r") == 0.1
    assert results_docs.evaluate(document, "sum(rows[shape.0=32].t)") == 6.0
    assert results_docs.evaluate(document, "count(rows[1:])") == 2
    assert results_docs.evaluate(document, "min(rows[shape.0=32][shape.1=0:5].t)") == 5.0
    with pytest.raises(ValueError, match="selects nothing"):
        results_docs.evaluate(document, "max(rows[shape.0=16].t)")


def test_the_readme_fits_a_newcomer():
    assert len((REPO / "README.md").read_text().splitlines()) <= 200


def _provenance_rows() -> list[tuple[list[str], str]]:
    """(files, commit) of each row of results/README.md's table."""
    rows = []
    for line in (REPO / "results" / "README.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0].startswith("`"):
            files = []
            for name in re.findall(r"`([^`]+)`", cells[0]):  # `.png`: the file before it, as a PNG
                files.append(os.path.splitext(files[-1])[0] + name if name.startswith(".") else name)
            rows.append((files, re.match(r"[0-9a-f]{7,40}", cells[2]).group(0)))
    return rows


def test_results_readme_names_every_file_and_its_stamped_commit():
    rows = _provenance_rows()
    listed = {f for files, _ in rows for f in files}
    present = {p.name for p in (REPO / "results").iterdir() if p.name != "README.md"}
    assert present - listed == set(), "files in results/ without a row"
    assert listed - present == set(), "rows naming no file"
    wrong = []
    for files, commit in rows:
        for name in files:
            if name.endswith((".json", ".jsonl")):
                stamped = {stamped_commit(s) for s in read_stamps(str(REPO / "results" / name))}
                wrong += [f"{name}: stamped {c[:12]}, the table says {commit}" for c in stamped
                          if not c.startswith(commit)]
    assert not wrong, "\n".join(wrong)


def test_the_plan_against_the_run(tmp_path):
    plan = {"peak_generation": 10.0, "peak_training": 6.0, "peak": 10.0}
    records = [{"run": {"memory_plan": plan}},
               {"step": 1, "memory/peak_generation_gib": 8.0, "memory/peak_training_gib": 5.0,
                "memory/peak_allocated_gib": 12.5},
               {"step": 2, "memory/peak_generation_gib": 8.0, "memory/peak_training_gib": 6.0,
                "memory/peak_allocated_gib": 12.5}]
    path = tmp_path / "run.jsonl"
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    older = tmp_path / "older.jsonl"  # steps without the phases' peaks
    older.write_text(json.dumps(records[0]) + "\n" + json.dumps({"step": 1, "memory/peak_allocated_gib": 8.0}) + "\n")
    assert results_docs.TABLES["plan_vs_run"](str(path), str(older)).splitlines()[2:] == [
        "| `run.jsonl` | generating | 10.0 | 8.0 | 1.25 |",
        "| `run.jsonl` | training | 6.0 | 6.0 | 1.00 |",
        "| `run.jsonl` | the run, its start included | 10.0 | 12.5 | 0.80 |",
        "| `older.jsonl` | the run, its start included | 10.0 | 8.0 | 1.25 |"]


def test_the_ablation_table_by_hand(tmp_path):
    def report(gemm_differ, default_first):
        components = [{"component": "layers.0.mlp", "rows": 10, "rows_different": gemm_differ},
                      {"component": "logprobs", "rows": 10, "rows_different": 3, "max_abs_diff": 0.25}]
        return {"ablation": [{"piece": "gemm", "tokens": 10, "tokens_different": gemm_differ,
                              "max_abs_diff": 0.5 * gemm_differ, "first_differing": "layers.0.mlp" if gemm_differ else None},
                             {"piece": "gdn_recurrent", "not_run": "no GDN layers"},
                             {"piece": "flash_version", "not_run": "FlashAttention-3 is not installed (install: ...)"}],
                "runs": {"default": {"components": components, "first_differing": default_first}}}
    paths = []
    for name, differ, first in (("dense.json", 8, "layers.0.mlp"), ("hybrid.json", 0, "layers.0.self_attention")):
        paths.append(str(tmp_path / name))
        (tmp_path / name).write_text(json.dumps(report(differ, first)))
    assert results_docs.TABLES["ablation"](*paths).splitlines() == [
        "| piece off | `dense.json` | `hybrid.json` |",
        "| --- | --- | --- |",
        "| gemm | 8 of 10, max 4, first at `layers.0.mlp` | 0 of 10, max 0 |",
        "| gdn_recurrent | not run: no GDN layers | not run: no GDN layers |",
        "| flash_version | not run: FlashAttention-3 is not installed | not run: FlashAttention-3 is not installed |",
        "| default mode (all off) | 3 of 10, max 0.25, first at `layers.0.mlp` "
        "| 3 of 10, max 0.25, first at `layers.0.self_attention` |"]


def test_an_edited_table_cell_is_drift_and_the_cli_says_so(tmp_path, monkeypatch, capsys):
    header = "<!-- table parity results/parity_dense_h200.json -->\n"
    right = header + results_docs.render_table("parity", "results/parity_dense_h200.json") + "\n<!-- /table -->"
    assert results_docs.regenerate(right, "doc")[1:] == ([], [])
    edited = right.replace("| 35.4% (99.0%) |", "| 34.4% (99.0%) |")
    assert edited != right
    written, drifted, errors = results_docs.regenerate(edited, "doc")
    assert errors == [] and drifted == ["doc:1: table parity differs from its files"] and written == right
    document = tmp_path / "doc.md"
    document.write_text(edited)
    (tmp_path / "results").symlink_to(REPO / "results")
    monkeypatch.setattr(results_docs, "documents", lambda: [document])
    monkeypatch.setattr(results_docs, "REPO", tmp_path)
    monkeypatch.setattr(sys, "argv", ["results_docs.py"])
    with pytest.raises(SystemExit) as exit_status:
        results_docs.main()
    assert exit_status.value.code == 1
    assert capsys.readouterr().out == "doc.md:1: table parity differs from its files\n"
