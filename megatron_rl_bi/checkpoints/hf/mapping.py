"""Which Megatron parameter is made of which Hugging Face tensors, and how, per family.

One list of rules serves both directions (import and export), so a round trip gives every
tensor back. Layouts (read from Megatron-Bridge's Qwen bridges and megatron-core's modules):
- attention `linear_qkv`: per query group g, [the group's query heads, (their output-gate heads
  when gated), its key head, its value head]; HF keeps q, k, v apart, and Qwen3.5's `q_proj`
  holds each head's query then its gate ([q_h, g_h] per head);
- MLP `linear_fc1`: [gate_proj; up_proj], an expert's too (`mlp.experts.{e}.*`, the router
  `mlp.gate` Megatron's `mlp.router`; Qwen3.5-MoE's `mlp.shared_expert.*` Megatron's
  `mlp.shared_experts`, its `mlp.shared_expert_gate` the shared experts' `gate_weight`);
- GDN `in_proj`: [q, k, v (HF's in_proj_qkv), z, beta (in_proj_b), alpha (in_proj_a)];
- Qwen3.5 layer i is Megatron's hybrid layers 2i (the mixer) and 2i + 1 (the MLP);
- embedding and output rows are padded to Megatron's padded vocabulary with zeros on import and
  cut back on export.
"""

from dataclasses import dataclass

import torch

from megatron_rl_bi.checkpoints.hf.config import HFModel, moe_layers

COPY, CONCAT, QKV, VOCAB = "copy", "concat", "qkv", "vocab"


@dataclass(frozen=True)
class Rule:
    megatron: str
    hf: tuple[str, ...]
    kind: str = COPY
    gated: bool = False  # QKV: Qwen3.5's q_proj carries an output gate per head


def _attention(mg: str, hf: str, gated: bool) -> list[Rule]:
    return [
        Rule(f"{mg}.self_attention.linear_qkv.weight",
             tuple(f"{hf}.self_attn.{p}_proj.weight" for p in "qkv"), QKV, gated),
        Rule(f"{mg}.self_attention.q_layernorm.weight", (f"{hf}.self_attn.q_norm.weight",)),
        Rule(f"{mg}.self_attention.k_layernorm.weight", (f"{hf}.self_attn.k_norm.weight",)),
        Rule(f"{mg}.self_attention.linear_proj.weight", (f"{hf}.self_attn.o_proj.weight",)),
    ]


def _mlp(mg: str, hf: str) -> list[Rule]:
    return [
        Rule(f"{mg}.pre_mlp_layernorm.weight", (f"{hf}.post_attention_layernorm.weight",)),
        Rule(f"{mg}.mlp.linear_fc1.weight",
             (f"{hf}.mlp.gate_proj.weight", f"{hf}.mlp.up_proj.weight"), CONCAT),
        Rule(f"{mg}.mlp.linear_fc2.weight", (f"{hf}.mlp.down_proj.weight",)),
    ]


def _swiglu(ours: str, theirs: str) -> list[Rule]:
    return [Rule(f"{ours}.linear_fc1.weight", (f"{theirs}.gate_proj.weight", f"{theirs}.up_proj.weight"), CONCAT),
            Rule(f"{ours}.linear_fc2.weight", (f"{theirs}.down_proj.weight",))]


def _moe(mg: str, hf: str, experts: int, gated_shared_expert: bool) -> list[Rule]:
    result = [Rule(f"{mg}.pre_mlp_layernorm.weight", (f"{hf}.post_attention_layernorm.weight",)),
              Rule(f"{mg}.mlp.router.weight", (f"{hf}.mlp.gate.weight",))]
    for e in range(experts):
        result += _swiglu(f"{mg}.mlp.experts.local_experts.{e}", f"{hf}.mlp.experts.{e}")
    if gated_shared_expert:
        result += [*_swiglu(f"{mg}.mlp.shared_experts", f"{hf}.mlp.shared_expert"),
                   Rule(f"{mg}.mlp.shared_experts.gate_weight", (f"{hf}.mlp.shared_expert_gate.weight",))]
    return result


def _gdn(mg: str, hf: str) -> list[Rule]:
    attn = f"{hf}.linear_attn"
    return [
        Rule(f"{mg}.self_attention.in_proj.weight",
             tuple(f"{attn}.in_proj_{p}.weight" for p in ("qkv", "z", "b", "a")), CONCAT),
        Rule(f"{mg}.self_attention.conv1d.weight", (f"{attn}.conv1d.weight",)),
        Rule(f"{mg}.self_attention.dt_bias", (f"{attn}.dt_bias",)),
        Rule(f"{mg}.self_attention.A_log", (f"{attn}.A_log",)),
        Rule(f"{mg}.self_attention.out_norm.weight", (f"{attn}.norm.weight",)),
        Rule(f"{mg}.self_attention.out_proj.weight", (f"{attn}.out_proj.weight",)),
    ]


def rules(model: HFModel, tied_embeddings: bool, final_norm: str) -> list[Rule]:
    """Every Megatron parameter of `model`'s architecture. HF names are relative to the language
    model (`model.` / `model.language_model.` is added by the caller); `final_norm` is the
    Megatron key of the stack's last norm (GPT and hybrid stacks name it differently)."""
    result = [Rule("embedding.word_embeddings.weight", ("embed_tokens.weight",), VOCAB),
              Rule(final_norm, ("norm.weight",))]
    if not tied_embeddings:
        result.append(Rule("output_layer.weight", ("lm_head.weight",), VOCAB))
    experts = moe_layers(model) if model.family == "qwen3_moe" else None
    for i in range(model.text_config["num_hidden_layers"]):
        hf = f"layers.{i}"
        if model.family in ("qwen3", "qwen3_moe"):
            mg = f"decoder.layers.{i}"
            mlp = _moe(mg, hf, model.num_experts, False) if experts and experts[i] else _mlp(mg, hf)
            result += [Rule(f"{mg}.input_layernorm.weight", (f"{hf}.input_layernorm.weight",)),
                       *_attention(mg, hf, gated=False), *mlp]
            continue
        mixer = f"decoder.layers.{2 * i}"
        result.append(Rule(f"{mixer}.input_layernorm.weight", (f"{hf}.input_layernorm.weight",)))
        if model.layer_types[i] == "full_attention":
            result += _attention(mixer, hf, gated=model.text_config.get("attn_output_gate", True))
        else:
            result += _gdn(mixer, hf)
        mlp = f"decoder.layers.{2 * i + 1}"
        result += _moe(mlp, hf, model.num_experts, True) if model.family == "qwen3_5_moe" else _mlp(mlp, hf)
    return result


def to_megatron(rule: Rule, tensors: list[torch.Tensor], megatron_shape: torch.Size,
                num_query_groups: int) -> torch.Tensor:
    if rule.kind == COPY:
        return tensors[0]
    if rule.kind == CONCAT:
        return torch.cat(tensors)
    if rule.kind == VOCAB:
        padded = tensors[0].new_zeros(megatron_shape)
        padded[: tensors[0].shape[0]] = tensors[0]
        return padded
    q, k, v = tensors
    head_dim = k.shape[0] // num_query_groups
    hidden = q.shape[-1]
    if rule.gated:  # [heads, (query, gate), head_dim, hidden]
        per_head = q.reshape(-1, 2, head_dim, hidden)
        parts = [per_head[:, 0], per_head[:, 1]]
    else:
        parts = [q.reshape(-1, head_dim, hidden)]
    groups = [p.reshape(num_query_groups, -1, hidden) for p in parts]
    groups += [t.reshape(num_query_groups, head_dim, hidden) for t in (k, v)]
    return torch.cat(groups, dim=1).reshape(-1, hidden)


def to_hf(rule: Rule, tensor: torch.Tensor, hf_shapes: list[torch.Size],
          num_query_groups: int) -> list[torch.Tensor]:
    """Inverse of `to_megatron`; `hf_shapes` are the HF tensors' shapes."""
    if rule.kind == COPY:
        return [tensor]
    if rule.kind == CONCAT:
        return list(torch.split(tensor, [s[0] for s in hf_shapes]))
    if rule.kind == VOCAB:
        return [tensor[: hf_shapes[0][0]]]
    q_rows, kv_rows = hf_shapes[0][0], hf_shapes[1][0]
    head_dim, hidden = kv_rows // num_query_groups, tensor.shape[-1]
    query_rows = q_rows // 2 if rule.gated else q_rows
    per_group = [query_rows // num_query_groups] * (2 if rule.gated else 1) + [head_dim, head_dim]
    parts = torch.split(tensor.reshape(num_query_groups, -1, hidden), per_group, dim=1)
    k, v = (p.reshape(-1, hidden) for p in parts[-2:])
    if rule.gated:
        query, gate = (p.reshape(-1, 1, head_dim, hidden) for p in parts[:2])
        q = torch.cat([query, gate], dim=1).reshape(-1, hidden)
    else:
        q = parts[0].reshape(-1, hidden)
    return [q, k, v]
