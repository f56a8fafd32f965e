"""A process that imported the engine ends without a stack dump when terminated (CPU): the main
job's output ended with `Stack (most recent call first): <no Python frame>` after a clean run,
from megatron-core's coordinator module registering faulthandler for SIGTERM at import
(compat.no_stack_dump_on_sigterm)."""

import signal
import subprocess
import sys

DUMP = "Stack (most recent call first)"


def _terminated_after_importing(module: str) -> subprocess.CompletedProcess:
    code = f"import os, signal, {module}; os.kill(os.getpid(), signal.SIGTERM)"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)


def test_a_process_that_imported_the_engine_terminates_without_a_stack_dump():
    result = _terminated_after_importing("megatron_rl_bi.inference")
    assert result.returncode == -signal.SIGTERM
    assert DUMP not in result.stderr


def test_upstream_still_registers():
    """Pins the upstream behaviour the compat undoes: when this fails, remove the compat."""
    result = _terminated_after_importing("megatron.core.inference.data_parallel_inference_coordinator.coordinator")
    assert DUMP in result.stderr
