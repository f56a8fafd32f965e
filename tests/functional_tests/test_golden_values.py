"""Megatron-style functional cases (tests/functional_tests/test_cases): each run compared with its
golden_values_dev_h200.json (GPU). Regenerate: python tools/golden_values.py regenerate."""

import importlib.util
import json
import math
import os

import pytest
import torch

from .. import REPO


pytestmark = pytest.mark.gpu

_spec = importlib.util.spec_from_file_location("golden_values", os.path.join(REPO, "tools", "golden_values.py"))
golden_values = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(golden_values)


@pytest.mark.parametrize("path", golden_values.all_cases(),
                         ids=lambda p: os.path.relpath(p, golden_values.CASES))
def test_case_matches_its_golden_values(path, tmp_path):
    case = golden_values.load_case(path)
    if int(case.env_vars.get("NPROC", 1)) > torch.cuda.device_count():
        pytest.skip(f"needs {case.env_vars['NPROC']} GPUs")
    golden_path = os.path.join(path, golden_values.GOLDEN)
    assert os.path.isfile(golden_path), f"no {golden_path}: python tools/golden_values.py regenerate"
    with open(golden_path) as f:
        golden = json.load(f)
    records, _ = golden_values.run_case(case, str(tmp_path), checking=True)
    steps = golden_values.case_steps(case)
    failures = golden_values.compare(golden, records, steps)
    assert not failures, "\n".join(failures)
    # The same run against a golden file with one loss value moved by one ulp must fail.
    last = str(golden["loss"]["end_step"])
    golden["loss"]["values"][last] = math.nextafter(golden["loss"]["values"][last], math.inf)
    assert golden_values.compare(golden, records, steps) == [
        f"loss step {last}: {records[int(last)]['loss']!r} != golden {golden['loss']['values'][last]!r}"
    ]
