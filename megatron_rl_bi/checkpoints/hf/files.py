"""Safetensors checkpoints on disk: reading tensors by name across shards, and writing a
directory atomically (shards + index + the source's config and tokenizer files) where it
replaces nothing but an earlier export."""

import json
import os
import shutil

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from megatron_rl_bi.jsonfile import read_object

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}
# Files a Hugging Face directory carries besides weights; copied from the source on export.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja",
                   "chat_template.json", "generation_config.json", "tokenizer.model")


def _open_shard(path: str):
    try:
        return safe_open(path, framework="pt")
    except SafetensorError as exc:  # a truncated or foreign file: its message names no file
        raise ValueError(f"{path}: not a safetensors file ({exc})") from exc


class SafetensorsReader:
    """Tensors of a checkpoint directory by name, opening each shard once."""

    def __init__(self, path: str):
        self.path = path
        index = os.path.join(path, INDEX)
        if os.path.isfile(index):
            weight_map = read_object(index).get("weight_map")
            if not isinstance(weight_map, dict):
                raise ValueError(f"{index}: no \"weight_map\" object")
            self.files = weight_map
        elif os.path.isfile(os.path.join(path, SINGLE)):
            with _open_shard(os.path.join(path, SINGLE)) as f:
                self.files = {name: SINGLE for name in f.keys()}
        else:
            raise ValueError(f"{path}: neither {INDEX} nor {SINGLE}")
        self._open = {}

    def names(self) -> set[str]:
        return set(self.files)

    def check_shards(self) -> None:
        """Every shard the index names is there, opens as safetensors (its header alone is read)
        and holds the tensors the index says it does."""
        for file in sorted(set(self.files.values())):
            path = os.path.join(self.path, file)
            if not os.path.isfile(path):
                raise ValueError(f"{self.path}: {INDEX} names {file}, which is not there")
            with _open_shard(path) as shard:
                held = set(shard.keys())
            if missing := sorted(n for n, f in self.files.items() if f == file and n not in held):
                raise ValueError(f"{path}: no tensor {missing[0]!r} ({len(missing)} missing), which {INDEX} puts there")

    def _shard(self, name: str):
        """The open shard holding `name` (opened once); names the tensor if it is missing."""
        if name not in self.files:
            raise ValueError(f"{self.path}: no tensor {name!r} in the checkpoint")
        file = self.files[name]
        if file not in self._open:
            self._open[file] = _open_shard(os.path.join(self.path, file))
        return self._open[file]

    def get(self, name: str) -> torch.Tensor:
        return self._shard(name).get_tensor(name)

    def _slice(self, name: str):
        """Shape and dtype without reading the tensor."""
        return self._shard(name).get_slice(name)

    def shape(self, name: str) -> torch.Size:
        return torch.Size(self._slice(name).get_shape())

    def dtype(self, name: str) -> torch.dtype:
        return _DTYPES[self._slice(name).get_dtype()]


def _shards(tensors: dict[str, torch.Tensor], max_shard_bytes: int) -> list[dict]:
    shards, current, size = [], {}, 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if current and size + nbytes > max_shard_bytes:
            shards.append(current)
            current, size = {}, 0
        current[name] = tensor
        size += nbytes
    return shards + ([current] if current else [])


def check_replaceable(path: str, flag: str, kind: str, is_output_file) -> None:
    """Refuses `path` (given as `flag`) unless it is absent, empty, or holds only files that
    `is_output_file(name)` says an earlier output of `kind` has: replacing it deletes the whole
    directory, and a user's directory (a run directory, say) must not go with it."""
    if not os.path.exists(path):
        return
    if not os.path.isdir(path):
        raise ValueError(f"{flag} {path}: exists and is not a directory; choose a new or empty directory")
    foreign = [name + "/" if os.path.isdir(os.path.join(path, name)) else name
               for name in sorted(os.listdir(path))
               if not (os.path.isfile(os.path.join(path, name)) and is_output_file(name))]
    if foreign:
        listed = ", ".join(foreign[:5]) + (", ..." if len(foreign) > 5 else "")
        raise ValueError(f"{flag} {path}: exists and holds files that are not {kind} ({listed}); "
                         "choose a new or empty directory")


def _is_export_file(name: str) -> bool:
    """A file `write_checkpoint` writes."""
    return name in ("config.json", INDEX, *TOKENIZER_FILES) or name.endswith(".safetensors")


def check_export_dir(path: str) -> None:
    """`path` may become an HF export: absent, empty, or an earlier export (periodic --save-hf
    exports replace their own)."""
    check_replaceable(path, "--save-hf", "an HF export", _is_export_file)


def write_checkpoint(out_dir: str, tensors: dict[str, torch.Tensor], config: dict,
                     source_dir: str, max_shard_bytes: int = 5 << 30) -> None:
    """Writes `out_dir` whole or not at all: everything goes to `out_dir.tmp`, which replaces
    `out_dir` only when complete (an existing `out_dir`, an earlier export, is kept until then)."""
    check_export_dir(out_dir)
    tmp = out_dir.rstrip("/") + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    shards = _shards(tensors, max_shard_bytes)
    weight_map = {}
    for i, shard in enumerate(shards, start=1):
        file = SINGLE if len(shards) == 1 else f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, os.path.join(tmp, file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, file))
    if len(shards) > 1:
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        with open(os.path.join(tmp, INDEX), "w", encoding="utf-8") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    with open(os.path.join(tmp, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
    for name in TOKENIZER_FILES:
        if os.path.isfile(os.path.join(source_dir, name)):
            shutil.copy2(os.path.join(source_dir, name), tmp)
    if os.path.exists(out_dir):
        shutil.rmtree(out_dir)
    os.replace(tmp, out_dir)
