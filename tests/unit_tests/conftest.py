import contextlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile

import pytest
import torch
import torch.nn.functional as F

from megatron_rl_bi.envs import sandbox

from .. import REPO


LOAD_PRETRAIN_RL = ("import importlib.util as _util\n"
                    "_spec = _util.spec_from_file_location('pretrain_rl', {path!r})\n"
                    "pretrain_rl = _util.module_from_spec(_spec)\n"
                    "_spec.loader.exec_module(pretrain_rl)  # every import of a run, before its main\n")


def run_after_loading_pretrain_rl(program: str, before: str = "", args: tuple[str, ...] = ()) -> str:
    """`program` in a Python process of its own once it has loaded pretrain_rl.py as `pretrain_rl`
    (`before` ahead of the load; `args` its sys.argv[1:]): its output's last line. Fails the test
    with the process's error output if it exits with an error."""
    source = before + "\n" + LOAD_PRETRAIN_RL.format(path=os.path.join(REPO, "pretrain_rl.py")) + program
    done = subprocess.run([sys.executable, "-c", source, *args], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip().splitlines()[-1]


def free_port() -> int:
    """A TCP port of 127.0.0.1 that nothing listens on now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class ScriptedGenerator:
    """What a scripted engine shares with the Generator besides generate(): its conversation()
    block, here with no prefix cache to keep."""

    def conversation(self):
        return contextlib.nullcontext()


@pytest.fixture
def single_config_autotune(monkeypatch):
    """Triton's autotuner times configs on a GPU driver; without one, take the first config."""
    if not torch.cuda.is_available():
        import triton.runtime.autotuner as autotuner

        monkeypatch.setattr(autotuner.Autotuner, "_bench", lambda self, *a, **k: [0.0, 0.0, 0.0])


@pytest.fixture
def gloo_group():
    """A one-process CPU process group, for code that calls torch.distributed collectives."""
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}",
                                         rank=0, world_size=1)
    yield
    torch.distributed.destroy_process_group()


@pytest.fixture
def cpu_dispatch(monkeypatch):
    """Makes megatron-core register its BI overrides for CPU tensors.

    It picks the dispatch key from `torch.accelerator.current_accelerator()`, which is CUDA for a
    CUDA build of torch even on a machine without a GPU; CPU tests run CPU tensors.
    """
    if not torch.cuda.is_available():
        monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda *check_available: None)


class CudaRng:
    """The CUDA generator's state, kept on the CPU."""

    def __init__(self):
        self.state = torch.zeros(16, dtype=torch.uint8)

    def get(self, device="cuda"):
        return self.state.clone()

    def set(self, state, device="cuda"):
        self.state = state.clone()


def _on_cpu(factory):
    def make(*args, device=None, **kwargs):
        return factory(*args, device="cpu" if str(device).startswith("cuda") else device, **kwargs)
    return make


@pytest.fixture
def cpu_training(gloo_group, monkeypatch):
    """megatron-core's model, DDP, optimizer and checkpointing on CPU: where it hard-codes CUDA
    (a few `device='cuda'` tensors, the CUDA RNG, stream syncs) the CPU takes its place;
    attention does not run (see cpu_forward). Yields the CUDA RNG stand-in."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random as mcore_random

    from megatron_rl_bi.attention import flash

    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    for name in ("tensor", "zeros", "ones", "empty", "full"):
        monkeypatch.setattr(torch, name, _on_cpu(getattr(torch, name)))
    rng = CudaRng()
    monkeypatch.setattr(torch.cuda, "get_rng_state", rng.get)
    monkeypatch.setattr(torch.cuda, "set_rng_state", rng.set)
    monkeypatch.setattr(mcore_random, "_get_cuda_rng_state", lambda *a, **k: rng.get())
    monkeypatch.setattr(mcore_random, "_set_cuda_rng_state", lambda state, *a, **k: rng.set(state))
    monkeypatch.setattr(flash, "flash_varlen_function", lambda version: None)  # no forward runs
    parallel_state.initialize_model_parallel(1, 1)
    yield rng
    parallel_state.destroy_model_parallel()


def torch_varlen_attention(q, k, v, cu_seqlens_q, softmax_scale, causal, **unused):
    """FlashAttention's varlen call, in torch: causal attention per packed sequence, GQA."""
    bounds = cu_seqlens_q.tolist()
    outs = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        q_, k_, v_ = (t[start:end].transpose(0, 1) for t in (q, k, v))  # [heads, L, d]
        repeat = q_.shape[0] // k_.shape[0]
        k_, v_ = k_.repeat_interleave(repeat, 0), v_.repeat_interleave(repeat, 0)
        out = F.scaled_dot_product_attention(q_, k_, v_, is_causal=causal, scale=softmax_scale)
        outs.append(out.transpose(0, 1))
    return torch.cat(outs)


@pytest.fixture
def cpu_forward(cpu_training, single_config_autotune, monkeypatch):
    """cpu_training, and the forward and backward too: attention runs the torch reference of
    FlashAttention's varlen call, GDN fla's recurrent kernel (in the Triton interpreter) and the
    torch chunked backward (fla's chunked kernels have no CPU path: models/gdn_rule.py's 'auto'
    backend takes the torch rule for CPU tensors)."""
    from megatron_rl_bi.attention import flash
    from megatron_rl_bi.models.gdn import SwitchedGatedDeltaNet

    monkeypatch.setattr(flash, "flash_varlen_function", lambda version: torch_varlen_attention)
    monkeypatch.setattr(SwitchedGatedDeltaNet, "_recurrent", staticmethod(lambda decode_only: True))
    yield cpu_training


@pytest.fixture
def slow_bubblewrap(monkeypatch):
    """bubblewrap started 4 s late, past a 3 s limit (a loaded host's start-up)."""
    directory = tempfile.mkdtemp(prefix="slow_bwrap_")
    os.chmod(directory, 0o755)  # the sandbox's host side runs as uid 65534 under root
    script = os.path.join(directory, "bwrap")
    with open(script, "w") as f:
        f.write(f'#!/bin/sh\nsleep 4\nexec {shutil.which(sandbox.BUBBLEWRAP)} "$@"\n')
    os.chmod(script, 0o755)
    monkeypatch.setattr(sandbox, "BUBBLEWRAP", script)
    yield
    shutil.rmtree(directory)
