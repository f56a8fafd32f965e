"""Importing the package turns on FlashAttention-4's disk cache of compiled kernels
(FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1) unless the environment already says, either way."""

import os
import subprocess
import sys

import pytest

VARIABLE = "FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED"


@pytest.mark.parametrize("given,expected", [(None, "1"), ("0", "0"), ("1", "1")])
def test_the_package_asks_for_the_cache_unless_told(given, expected):
    environment = {key: value for key, value in os.environ.items() if key != VARIABLE}
    if given is not None:
        environment[VARIABLE] = given
    result = subprocess.run([sys.executable, "-c", f"import os, megatron_rl_bi; print(os.environ['{VARIABLE}'])"],
                            env=environment, capture_output=True, text=True, check=True)
    assert result.stdout.strip() == expected
