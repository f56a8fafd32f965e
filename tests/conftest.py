import os

import pytest
import torch

# Without a GPU, Triton kernels (megatron-core's BI kernels, fla's recurrent kernel) run in the
# Triton interpreter on CPU tensors. Must be set before triton.jit decorates anything.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run on the H200: see README, GPU tests)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
