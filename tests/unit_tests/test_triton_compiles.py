"""reporting/compiles.py: Triton's compilations tallied by hand, and through the installed Triton,
which compiles for an H100/H200 (sm_90a) on the CPU (in a process of its own: this one's kernels
run in Triton's interpreter and do not compile)."""

import json
import os
import subprocess
import sys

import pytest
import triton
import triton.language as tl
from triton import knobs

from megatron_rl_bi.reporting.compiles import TritonCompiles, count_triton_compiles

from .. import REPO
from ..sm90_spills import PTXAS, compiling_environment


@triton.jit
def _copy(source, target, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(target + offsets, tl.load(source + offsets, mask=offsets < n), mask=offsets < n)


def _times(*microseconds: int) -> knobs.CompileTimes:
    first, *stages, last = microseconds
    return knobs.CompileTimes(ir_initialization=first, lowering_stages=[(f"stage{i}", t) for i, t in enumerate(stages)],
                              store_results=last)


def test_compilations_and_cache_loads_are_tallied_until_taken():
    tally = TritonCompiles()
    tally(times=_times(1_000, 250_000, 500_000, 2_000), cache_hit=False, src=None, metadata={}, metadata_group={})
    tally(times=_times(500, 0, 100_000, 500), cache_hit=False, src=None, metadata={}, metadata_group={})
    tally(times=_times(40, 0, 0, 10), cache_hit=True, src=None, metadata={}, metadata_group={})
    assert tally.take() == {"time/triton_compiles": 2, "time/triton_compile_s": 0.753 + 0.101,
                            "time/triton_cache_loads": 1}
    assert tally.take() == {"time/triton_compiles": 0, "time/triton_compile_s": 0.0, "time/triton_cache_loads": 0}


def test_the_listener_it_replaced_still_hears_every_compilation(monkeypatch):
    heard = []
    monkeypatch.setattr(knobs.compilation, "listener", lambda **compilation: heard.append(compilation))
    tally = count_triton_compiles()
    assert knobs.compilation.listener is tally and count_triton_compiles() is tally
    times = _times(1, 2, 3)
    tally(times=times, cache_hit=True, src="source", metadata={"name": "k"}, metadata_group={})
    assert heard == [{"times": times, "cache_hit": True, "src": "source", "metadata": {"name": "k"},
                      "metadata_group": {}}]


COMPILING = """
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from megatron_rl_bi.reporting.compiles import count_triton_compiles
from tests.unit_tests.test_triton_compiles import _copy
microseconds = []
triton.knobs.compilation.listener = lambda **compilation: microseconds.append(compilation["times"].total)
tally = count_triton_compiles()
def compile(block):
    source = ASTSource(_copy, signature={"source": "*fp32", "target": "*fp32", "n": "i32", "BLOCK": "constexpr"},
                       constexprs={(3,): block})
    triton.compile(source, target=GPUTarget("cuda", 90, 32))
compile(64)
compile(128)
first = tally.take()
compile(64)
print(json.dumps({"first": first, "second": tally.take(), "microseconds": microseconds}))
"""


@pytest.mark.skipif(not os.path.exists(PTXAS), reason=f"no ptxas at {PTXAS}")
def test_the_installed_triton_reports_its_compilations_and_cache_loads(tmp_path):
    """Two variants compiled into an empty cache, then one of them loaded from it."""
    environment = compiling_environment(TRITON_CACHE_DIR=str(tmp_path))
    done = subprocess.run([sys.executable, "-c", COMPILING], cwd=REPO, env=environment, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.splitlines()[-1])
    compiled = report["microseconds"][:2]
    assert len(report["microseconds"]) == 3 and min(compiled) > 0
    assert report["first"] == {"time/triton_compiles": 2, "time/triton_compile_s": compiled[0] / 1e6 + compiled[1] / 1e6,
                               "time/triton_cache_loads": 0}
    assert report["second"] == {"time/triton_compiles": 0, "time/triton_compile_s": 0.0, "time/triton_cache_loads": 1}
