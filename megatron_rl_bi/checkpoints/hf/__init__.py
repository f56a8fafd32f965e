"""Hugging Face checkpoints in and out: Qwen3 (dense) and Qwen3.5 (GDN hybrid).

`read_hf_model` + `megatron_flags` give the flags that build the architecture (`config.py`);
`load_hf_weights` fills the built model (the trainer's module, which the engine shares) and
`export_hf` writes it back as a directory that `transformers` loads (`mapping.py`, `files.py`).
"""

import logging

import torch
from megatron.core.utils import unwrap_model

from megatron_rl_bi.checkpoints.hf.config import HFModel, megatron_flags, read_hf_model
from megatron_rl_bi.checkpoints.hf.files import SafetensorsReader, write_checkpoint
from megatron_rl_bi.checkpoints.hf.mapping import Rule, rules, to_hf, to_megatron

__all__ = ["HFModel", "check_hf_weights", "export_hf", "load_hf_weights", "megatron_flags", "read_hf_model"]

logger = logging.getLogger(__name__)

# TransformerEngine's fused norm+linear keeps the preceding norm inside the linear: (local
# name, TE name) pairs; an attention layer's input norm goes into linear_qkv, a GDN layer's into
# in_proj.
_TE_NAMES = ((".input_layernorm.weight", ".self_attention.linear_qkv.layer_norm_weight"),
             (".input_layernorm.weight", ".self_attention.in_proj.layer_norm_weight"),
             (".pre_mlp_layernorm.weight", ".mlp.linear_fc1.layer_norm_weight"))
# Parts of a checkpoint that are not the language model: left out, with a note.
_SKIPPED_PREFIXES = ("mtp.", "model.visual.", "visual.")


def _bare_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The bare model's parameters and buffers by Megatron name (TE's `_extra_state` left out)."""
    return {k: v for k, v in unwrap_model(model).state_dict().items()
            if torch.is_tensor(v) and not k.endswith("_extra_state")}


def _megatron_key(rule: Rule, state: dict) -> str:
    if rule.megatron in state:
        return rule.megatron
    for local, te in _TE_NAMES:
        if rule.megatron.endswith(local) and rule.megatron.replace(local, te) in state:
            return rule.megatron.replace(local, te)
    raise ValueError(f"the built model has no parameter {rule.megatron!r}: its flags do not "
                     "match the checkpoint's architecture")


def _plan(hf: HFModel, state: dict) -> list[tuple[str, Rule]]:
    final_norm = next(k for k in state if k.startswith("decoder.final_") and k.endswith("norm.weight"))
    tied = "output_layer.weight" not in state
    return [(_megatron_key(rule, state), rule) for rule in rules(hf, tied, final_norm)]


def _language_model_prefix(names: set[str]) -> str:
    return "model.language_model." if any(n.startswith("model.language_model.") for n in names) else "model."


def _hf_name(prefix: str, name: str) -> str:
    return name if name.startswith("lm_head.") else prefix + name


def check_hf_weights(hf: HFModel) -> None:
    """Before any GPU work: the checkpoint's weight files are there and readable, and hold a tensor
    of every name the config's architecture needs (their shapes are checked as they load)."""
    reader = SafetensorsReader(hf.path)
    reader.check_shards()
    prefix = _language_model_prefix(reader.names())
    tied = hf.text_config.get("tie_word_embeddings", False)
    needed = {_hf_name(prefix, n) for rule in rules(hf, tied, "final norm") for n in rule.hf}
    if missing := sorted(needed - reader.names()):
        raise ValueError(f"--hf-checkpoint {hf.path}: no tensor {missing[0]!r} ({len(missing)} of the "
                         f"{len(needed)} its config.json's architecture needs are missing)")


@torch.no_grad()
def load_hf_weights(model: torch.nn.Module, hf: HFModel) -> None:
    """Copies every tensor of `hf`'s checkpoint into `model` (built from `megatron_flags(hf)`).
    Fails, naming the tensor, on any shape mismatch or parameter left unfilled."""
    state, reader = _bare_state(model), SafetensorsReader(hf.path)
    prefix = _language_model_prefix(reader.names())
    filled, used = set(), set()
    groups = hf.text_config["num_key_value_heads"]
    for key, rule in _plan(hf, state):
        names = [_hf_name(prefix, n) for n in rule.hf]
        tensor = to_megatron(rule, [reader.get(n) for n in names], state[key].shape, groups)
        if tensor.shape != state[key].shape:
            raise ValueError(f"{hf.path}: {names} give {tuple(tensor.shape)} for {key}, whose "
                             f"shape is {tuple(state[key].shape)}")
        state[key].copy_(tensor)
        filled.add(key)
        used.update(names)
    unfilled = sorted(k for k in state if k not in filled and "rotary" not in k)
    if unfilled:
        raise ValueError(f"{hf.path}: no tensors for {unfilled[:5]} ({len(unfilled)} in all)")
    left = reader.names() - used
    if "output_layer.weight" not in state:
        left.discard("lm_head.weight")  # tied: some checkpoints store the shared matrix twice
    skipped = {n for n in left if n.startswith(_SKIPPED_PREFIXES)}
    if left - skipped:
        raise ValueError(f"{hf.path}: tensors not used by the model: {sorted(left - skipped)[:5]}")
    if skipped:
        logger.warning("%s: %d tensors of the MTP head / vision tower not loaded (text model only)",
                       hf.path, len(skipped))


# a nested (vision + text) family's text model: its model type and transformers' class
_TEXT_MODELS = {"qwen3_5": ("qwen3_5_text", "Qwen3_5ForCausalLM"),
                "qwen3_5_moe": ("qwen3_5_moe_text", "Qwen3_5MoeForCausalLM")}


def _export_config(hf: HFModel) -> dict:
    """The config to write: a nested Qwen3.5 (vision + text) exports its text model alone."""
    if hf.text_config is hf.config:
        return hf.config
    model_type, architecture = _TEXT_MODELS[hf.family]
    return {**hf.text_config, "model_type": model_type, "architectures": [architecture]}


@torch.no_grad()
def export_hf(model: torch.nn.Module, hf: HFModel, out_dir: str) -> None:
    """Writes `model`'s weights as a Hugging Face directory shaped like `hf` (its config, its
    tokenizer files, its tensors' dtypes and shapes), atomically."""
    state, reader = _bare_state(model), SafetensorsReader(hf.path)
    source_prefix = _language_model_prefix(reader.names())
    tensors = {}
    groups = hf.text_config["num_key_value_heads"]
    for key, rule in _plan(hf, state):
        sources = [_hf_name(source_prefix, n) for n in rule.hf]
        shapes = [reader.shape(n) for n in sources]
        for name, source, tensor in zip(rule.hf, sources, to_hf(rule, state[key], shapes, groups)):
            tensors[_hf_name("model.", name)] = tensor.detach().to("cpu", reader.dtype(source)).contiguous()
    write_checkpoint(out_dir, tensors, _export_config(hf), hf.path)
