"""Checkpoint atomicity on CPU (single-process gloo group): a save that crashes half way leaves the
previous checkpoint as `latest`, and the next save cleans the partial directory up. The sharded
model/optimizer state is replaced by a small stand-in; the writing protocol is the real one."""

import os

import pytest
import torch

from megatron_rl_bi.checkpoints import megatron as checkpoint


@pytest.fixture
def fake_state(monkeypatch):
    """Stand-ins for the GPU-only parts: the sharded state dict, its writer and CUDA RNG."""
    writes = []

    def save(state, directory):
        writes.append(directory)
        with open(os.path.join(directory, "shard.pt"), "wb") as f:
            torch.save(state, f)

    monkeypatch.setattr(checkpoint, "_sharded_state_dict", lambda *a, **k: {"w": torch.ones(2)})
    monkeypatch.setattr(checkpoint, "_rng_state", lambda: {"python": 1})
    monkeypatch.setattr(checkpoint.dist_checkpointing, "save", save)
    return writes


def test_save_then_crash_keeps_previous_latest(tmp_path, gloo_group, fake_state, monkeypatch):
    root = str(tmp_path)
    checkpoint.save_checkpoint(root, 5, None, None, {"step": 5, "source": {"position": 40}})
    assert checkpoint.latest_step(root) == 5
    assert sorted(os.listdir(root)) == ["iter_0000005", checkpoint.LATEST]
    rl_state = torch.load(os.path.join(root, "iter_0000005", "rl_state.pt"), weights_only=False)
    assert rl_state["step"] == 5 and rl_state["ranks"][0]["source"] == {"position": 40}

    def crash(state, directory):
        open(os.path.join(directory, "half-written"), "w").close()
        raise OSError("disk full")

    monkeypatch.setattr(checkpoint.dist_checkpointing, "save", crash)
    with pytest.raises(OSError, match="disk full"):
        checkpoint.save_checkpoint(root, 10, None, None, {"step": 10})
    assert checkpoint.latest_step(root) == 5  # the crash did not move `latest`
    assert "iter_0000010" not in os.listdir(root)  # nor publish a partial checkpoint

    monkeypatch.setattr(checkpoint.dist_checkpointing, "save",
                        lambda state, directory: fake_state.append(directory))
    checkpoint.save_checkpoint(root, 15, None, None, {"step": 15})
    assert checkpoint.latest_step(root) == 15
    assert sorted(os.listdir(root)) == ["iter_0000005", "iter_0000015", checkpoint.LATEST]


def test_latest_step_errors_name_the_file(tmp_path):
    assert checkpoint.latest_step(str(tmp_path)) is None
    (tmp_path / checkpoint.LATEST).write_text("garbage")
    with pytest.raises(ValueError, match="latest_checkpointed_iteration.txt: expected a step"):
        checkpoint.latest_step(str(tmp_path))
