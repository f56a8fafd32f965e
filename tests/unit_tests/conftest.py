import pytest
import torch


@pytest.fixture
def cpu_dispatch(monkeypatch):
    """Makes megatron-core register its BI overrides for CPU tensors.

    It picks the dispatch key from `torch.accelerator.current_accelerator()`, which is CUDA for a
    CUDA build of torch even on a machine without a GPU; CPU tests run CPU tensors.
    """
    if not torch.cuda.is_available():
        monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda: None)
