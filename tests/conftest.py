import json
import os

import pytest
import torch

# Without a GPU, Triton kernels (megatron-core's BI kernels, fla's recurrent kernel) run in the
# Triton interpreter on CPU tensors. Must be set before triton.jit decorates anything.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")



class OutcomeRecorder:
    """Each test's outcome: its call's, or its setup's when that failed or skipped it."""

    def __init__(self):
        self.outcomes: dict[str, str] = {}

    def pytest_runtest_logreport(self, report):
        if report.when == "call" or report.outcome != "passed":
            self.outcomes.setdefault(report.nodeid, report.outcome)


def pytest_addoption(parser):
    parser.addoption("--test-report", metavar="FILE", default=None,
                     help="write every test's outcome, with provenance, to FILE (JSON): the "
                     "record of a GPU run that results/ and docs/testing.md cite")


def pytest_configure(config):
    config.pluginmanager.register(OutcomeRecorder(), "outcome_recorder")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run on the H200: see README, GPU tests)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session, exitstatus):
    path = session.config.getoption("--test-report")
    if not path:
        return
    from megatron_rl_bi.reporting.provenance import provenance

    outcomes = session.config.pluginmanager.get_plugin("outcome_recorder").outcomes
    counts = {kind: sum(o == kind for o in outcomes.values()) for kind in ("passed", "failed", "skipped")}
    with open(path, "w") as f:
        json.dump({**provenance(), "exit_status": int(exitstatus), "counts": counts, "tests": outcomes}, f,
                  indent=2)
