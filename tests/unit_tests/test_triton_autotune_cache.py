"""Importing the package asks Triton's autotuners to keep their picks on disk
(TRITON_CACHE_AUTOTUNING=1) unless the environment already says, either way: megatron-core's
autotuned kernels, imported after it, keep theirs (a process of its own, without the CPU tests'
Triton interpreter, under which nothing is cached)."""

import os
import subprocess
import sys

import pytest

VARIABLE = "TRITON_CACHE_AUTOTUNING"
SCRIPT = ("import os, megatron_rl_bi\n"
          "from megatron.core.ssm.ops import ssd_bmm\n"
          f"print(os.environ['{VARIABLE}'], ssd_bmm._bmm_chunk_fwd_kernel.cache_results)\n")


@pytest.mark.parametrize("given,expected", [(None, "1 True"), ("0", "0 False"), ("1", "1 True")])
def test_the_package_asks_for_the_autotuners_disk_cache_unless_told(given, expected):
    environment = {key: value for key, value in os.environ.items() if key not in (VARIABLE, "TRITON_INTERPRET")}
    if given is not None:
        environment[VARIABLE] = given
    result = subprocess.run([sys.executable, "-c", SCRIPT], env=environment, capture_output=True, text=True,
                            check=True)
    assert result.stdout.strip().splitlines()[-1] == expected
