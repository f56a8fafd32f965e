"""The BI GEMMs' kernels and the RMSNorm backward compiled for an H100/H200 (sm_90a) on the CPU with
the installed Triton and ptxas (tests/sm90_spills.py, in a process of its own): every tile the host
code can pick compiles in each operand layout the forward and backward give it, and none spills
registers to local memory (a spilled accumulator turns a product's time over); integers left
unspecialized cost no instruction. Whether the kernels give the right bits is for the other tests."""

import dataclasses
import json
import os
import subprocess
import sys

import pytest

from megatron_rl_bi.bi import gemm

from .. import REPO
from ..sm90_spills import PTXAS, compiling_environment

pytestmark = pytest.mark.skipif(not os.path.exists(PTXAS), reason=f"no ptxas at {PTXAS}")

# (A column-major, B column-major): forward x @ W.T, input gradient dY @ W, weight gradient dY.T @ X
LAYOUTS = [(False, True), (False, False), (True, False)]
VARIANTS = [(config, *layout) for *_, config in gemm.TILE_CONFIGS for layout in LAYOUTS]
# 256x256 over 8 warps: 256 fp32 accumulators a thread, more than the 255 registers it may have
SPILLING = (gemm.TileConfig(256, 256, 3, 8), False, True)


@pytest.fixture(scope="module")
def spills() -> dict:
    variants = [[*dataclasses.astuple(config), a_cm, b_cm] for config, a_cm, b_cm in VARIANTS + [SPILLING]]
    result = subprocess.run([sys.executable, "-m", "tests.sm90_spills", json.dumps(variants)], cwd=REPO,
                            env=compiling_environment(), capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.splitlines()[-1])


def test_every_picked_tile_compiles_without_spilling(spills):
    spilled = [variant for variant, bytes_ in zip(VARIANTS, spills["matmul"]) if bytes_]
    assert not spilled and len(VARIANTS) == 15


def test_a_tile_and_layout_compile_once_whatever_the_products_sizes(spills):
    """Triton compiles a variant for each specialization of a launch's arguments: the integers
    that vary between calls of one layer (rows, K, strides, programs) are not specialized, so
    each tile and layout is one kernel (the tiny hybrid recipe's fresh run had compiled 25)."""
    assert spills["matmul_launch_keys"][:len(VARIANTS)] == [1] * len(VARIANTS)


def test_unspecialized_integers_cost_no_instruction(spills):
    """Each variant as launched compiles to the machine code it has with every integer argument a
    multiple of 16 (bias epilogue included): the fewer compiles cost no GPU time."""
    assert spills["matmul_as_specialized"][:len(VARIANTS)] == [True] * len(VARIANTS)


def test_a_tile_too_large_for_the_registers_is_seen_to_spill(spills):
    """A check that the spill count is read at all."""
    assert spills["matmul"][-1] > 0


def test_the_grouped_kernel_compiles_without_spilling(spills):
    assert spills["grouped"] == 0


def test_the_rmsnorm_backward_compiles_once_a_width_at_no_cost(spills):
    """Its row count is not specialized: one variant over 1 to 1,000 rows (the tiny hybrid
    recipe's fresh run compiled 4 for its 2 widths), with the machine code of its compile with
    rows a multiple of 16."""
    assert spills["rmsnorm_backward"] == {"as_specialized": True, "launch_keys": 1}


def test_the_gdn_backward_step_compiles_once_a_width_at_no_cost(spills):
    """Its token count is not specialized: one variant over packed batches of 1 to 1,000 tokens
    (three before: 1, a multiple of 16, other; a step whose count fell in a class not met before
    compiled again), with the machine code of its compile with the count a multiple of 16."""
    assert spills["gdn_dqkwg"] == {"as_specialized": True, "launch_keys": 1}
