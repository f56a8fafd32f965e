"""Checkpoint safety on CPU (single-process gloo group): a save that crashes half way leaves the
previous checkpoint as `latest`, and the next save cleans the partial directory up; re-saving an
existing iteration never removes the complete copy before the new one is in place; retention;
read errors name the path; the RL state loads without unpickling objects. The sharded
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
    ranks = checkpoint.read_rl_state(os.path.join(root, "iter_0000005"))  # weights_only
    assert ranks[0]["source"] == {"position": 40} and ranks[0]["rng"] == {"python": 1}

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


def _crash(state, directory):
    open(os.path.join(directory, "half-written"), "w").close()
    raise OSError("disk full")


def test_resaving_an_iteration_keeps_the_complete_copy_until_replaced(tmp_path, gloo_group,
                                                                      fake_state, monkeypatch):
    root = str(tmp_path)
    checkpoint.save_checkpoint(root, 5, None, None, {"source": {"position": 1}})
    monkeypatch.setattr(checkpoint.dist_checkpointing, "save", _crash)
    with pytest.raises(OSError, match="disk full"):
        checkpoint.save_checkpoint(root, 5, None, None, {"source": {"position": 2}})
    ranks = checkpoint.read_rl_state(os.path.join(root, "iter_0000005"))
    assert ranks[0]["source"] == {"position": 1}  # the good copy is untouched


def test_a_crash_between_the_two_renames_loses_nothing(tmp_path, gloo_group, fake_state):
    root = str(tmp_path)
    checkpoint.save_checkpoint(root, 5, None, None, {"source": {"position": 1}})
    # state after `iter_5 -> iter_5.old` and before `iter_5.tmp -> iter_5`
    os.replace(os.path.join(root, "iter_0000005"), os.path.join(root, "iter_0000005.old"))
    assert checkpoint._checkpoint_path(root, 5).endswith("iter_0000005.old")
    checkpoint.save_checkpoint(root, 6, None, None, {"source": {"position": 2}})
    assert sorted(os.listdir(root)) == ["iter_0000005", "iter_0000006", checkpoint.LATEST]


def test_keep_last_k(tmp_path, gloo_group, fake_state):
    root = str(tmp_path)
    for step in (1, 2, 3, 4):
        checkpoint.save_checkpoint(root, step, None, None, {}, keep_last=2)
    assert sorted(os.listdir(root)) == ["iter_0000003", "iter_0000004", checkpoint.LATEST]


def test_read_errors_name_the_path(tmp_path):
    (tmp_path / checkpoint.LATEST).write_text("7")
    with pytest.raises(ValueError, match="names step 7, but .*iter_0000007 is missing"):
        checkpoint._checkpoint_path(str(tmp_path), 7)
    (tmp_path / "iter_0000007").mkdir()
    (tmp_path / "iter_0000007" / checkpoint.RL_STATE).write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match=r"iter_0000007/rl_state.pt: cannot read the RL state"):
        checkpoint.read_rl_state(str(tmp_path / "iter_0000007"))


class _Arbitrary:
    pass


def test_rl_state_with_arbitrary_objects_is_refused(tmp_path):
    torch.save({"step": 1, "ranks": [{"evil": _Arbitrary()}]}, tmp_path / checkpoint.RL_STATE)
    with pytest.raises(ValueError, match="cannot read the RL state"):
        checkpoint.read_rl_state(str(tmp_path))


def test_python_and_torch_rng_states_load_without_pickle(tmp_path):
    import random

    state = {"step": 1, "ranks": [{"rng": {"python": random.getstate(),
                                           "torch": torch.get_rng_state()}}]}
    torch.save(state, tmp_path / checkpoint.RL_STATE)
    rng = checkpoint.read_rl_state(str(tmp_path))[0]["rng"]
    random.setstate(rng["python"])
    assert torch.equal(rng["torch"], torch.get_rng_state())


class _Weights:
    def sharded_state_dict(self, metadata):
        return {"w": torch.ones(2)}


def test_save_weights_replaces_nothing_but_an_earlier_checkpoint(tmp_path, gloo_group, monkeypatch):
    def save(state, directory):  # the files a torch_dist save writes
        for name in ("__0_0.distcp", ".metadata", "metadata.json"):
            open(os.path.join(directory, name), "w").close()

    monkeypatch.setattr(checkpoint.dist_checkpointing, "save", save)
    monkeypatch.setattr(checkpoint.parallel_state, "get_data_parallel_group", lambda **k: None)
    out = tmp_path / "weights"
    for _ in range(2):  # written, then written again over itself
        checkpoint.save_weights(_Weights(), str(out))
    assert sorted(os.listdir(out)) == [".metadata", "__0_0.distcp", "metadata.json"]
    (tmp_path / "empty").mkdir()
    checkpoint.save_weights(_Weights(), str(tmp_path / "empty"))

    run = tmp_path / "run"
    (run / "iter_0000005").mkdir(parents=True)
    (run / checkpoint.LATEST).write_text("5")
    with pytest.raises(ValueError, match=r"^--save .*run: exists and holds files that are not a torch_dist "
                                         r"checkpoint \(iter_0000005/, latest_checkpointed_iteration.txt\)"):
        checkpoint.save_weights(_Weights(), str(run))
    assert sorted(os.listdir(run)) == ["iter_0000005", checkpoint.LATEST]
    assert not os.path.exists(str(run) + ".tmp")


def test_a_missing_pretrained_checkpoint_names_the_callers_flag(tmp_path):
    with pytest.raises(ValueError, match=r"^--pretrained-checkpoint .*: neither a dist checkpoint"):
        checkpoint.resolve_checkpoint_dir(str(tmp_path))
    with pytest.raises(ValueError, match=r"^--load .*: neither a dist checkpoint"):
        checkpoint.resolve_checkpoint_dir(str(tmp_path), "--load")


def test_every_file_and_directory_is_on_disk_before_the_checkpoint_is_published(tmp_path, gloo_group,
                                                                                fake_state, monkeypatch):
    events, fsync, replace = [], checkpoint._fsync, os.replace
    monkeypatch.setattr(checkpoint, "_fsync", lambda path: (events.append(("fsync", path)), fsync(path)))
    monkeypatch.setattr(checkpoint.os, "replace", lambda a, b: (events.append(("replace", a, b)), replace(a, b)))
    final = checkpoint.save_checkpoint(str(tmp_path), 5, None, None, {"step": 5})
    tmp = final + ".tmp"
    published = events.index(("replace", tmp, final))
    synced = {event[1] for event in events[:published] if event[0] == "fsync"}
    written = {os.path.join(tmp, name) for name in os.listdir(final)}
    assert written == {os.path.join(tmp, "shard.pt"), os.path.join(tmp, checkpoint.RL_STATE)}
    assert written | {tmp, str(tmp_path)} <= synced  # the files, their directory, its parent
    latest = os.path.join(str(tmp_path), checkpoint.LATEST)
    assert events.index(("replace", latest + ".tmp", latest)) > published
