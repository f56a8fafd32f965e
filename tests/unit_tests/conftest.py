import socket

import pytest
import torch


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
        monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda: None)
