"""A Hugging Face `config.json` -> the Megatron flags that build the same model.

Families: Qwen3 (`model_type` "qwen3", dense), Qwen3-MoE (`qwen3_moe`: Qwen3's attention, and
in the layers `decoder_sparse_step` and `mlp_only_layers` name a mixture of experts with its
router, softmax top-k, normalized when `norm_topk_prob`) and Qwen3.5 (`qwen3_5_text`, or
`qwen3_5` whose nested `text_config` is used and whose vision tower is left out): a hybrid of
Gated DeltaNet ('G') and gated full-attention ('*') mixers, each followed by a dense MLP ('-'),
zero-centred RMSNorm weights, partial rotary embeddings. Qwen3.5-MoE (`qwen3_5_moe_text`, or
`qwen3_5_moe` with a `text_config`) is Qwen3.5 with every MLP a mixture of experts ('E'): the
normalized softmax top-k, and a shared expert scaled by the sigmoid of its own gate. Features the
mapping does not cover (shared experts outside Qwen3.5-MoE, sliding windows, rope scaling,
attention biases, other activations) fail here with the key that says so, before any weight is
read.
"""

import os
from dataclasses import dataclass

from megatron_rl_bi.jsonfile import read_object

FAMILIES = ("qwen3", "qwen3_moe", "qwen3_5", "qwen3_5_moe")
HYBRID_FAMILIES = ("qwen3_5", "qwen3_5_moe")
MOE_FAMILIES = ("qwen3_moe", "qwen3_5_moe")


@dataclass(frozen=True)
class HFModel:
    """What this package needs to know of a checkpoint directory."""

    path: str
    family: str  # one of FAMILIES
    text_config: dict  # the language model's config (Qwen3.5: `text_config` when nested)
    config: dict  # config.json as written

    @property
    def vocab_size(self) -> int:
        return self.positive("vocab_size", int)

    @property
    def num_experts(self) -> int:
        """The experts of a MoE layer: `num_experts` (the published configs) or
        `num_local_experts` (what transformers 5 writes)."""
        key = "num_experts" if "num_experts" in self.text_config else "num_local_experts"
        return self.positive(key, int)

    @property
    def layer_types(self) -> list[str]:
        """Qwen3.5: 'linear_attention' or 'full_attention' per layer."""
        cfg, layers = self.text_config, self.positive("num_hidden_layers", int)
        if cfg.get("layer_types"):
            if len(cfg["layer_types"]) != layers:
                raise ValueError(f"{self.path}/config.json: {len(cfg['layer_types'])} layer_types for "
                                 f"num_hidden_layers {layers}")
            return list(cfg["layer_types"])
        interval = self.positive("full_attention_interval", int) if "full_attention_interval" in cfg else 4
        return ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(layers)]

    def positive(self, key: str, kind: type) -> int | float:
        """The language model's `key`, which must be a positive `kind` (int, or float, which takes
        ints too); a missing or wrong value names the file and the key."""
        name = key if self.text_config is self.config else f"text_config.{key}"
        if key not in self.text_config:
            raise ValueError(f"{self.path}/config.json: missing key {name!r}")
        value = self.text_config[key]
        kinds = (int, float) if kind is float else (int,)
        if isinstance(value, bool) or not isinstance(value, kinds) or value <= 0:
            raise ValueError(f"{self.path}/config.json: {name} is {value!r}; a positive {kind.__name__} is needed")
        return value


def read_hf_model(path: str) -> HFModel:
    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        raise ValueError(f"--hf-checkpoint {path}: no config.json there")
    config = read_object(config_path)
    model_type = config.get("model_type")
    if model_type in ("qwen3", "qwen3_moe"):
        return HFModel(path, model_type, config, config)
    for family in HYBRID_FAMILIES:
        if model_type == f"{family}_text":
            return HFModel(path, family, config, config)
        if model_type == family and isinstance(config.get("text_config"), dict):
            return HFModel(path, family, config["text_config"], config)
    raise ValueError(f"{config_path}: model_type {model_type!r} is not supported (qwen3, qwen3_moe, "
                     "qwen3_5_text, qwen3_5_moe_text, or qwen3_5 / qwen3_5_moe with a text_config)")


def _rope(model: HFModel) -> tuple[float, float]:
    """(rope theta, rotary fraction) from either config layout (transformers 5's
    `rope_parameters`, or top-level `rope_theta` / `partial_rotary_factor` / `rope_scaling`)."""
    cfg = model.text_config
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        raise ValueError(f"{model.path}/config.json: rope_type {rope_type!r} is not supported "
                         "(only the default rope)")
    theta = params.get("rope_theta", cfg.get("rope_theta"))
    default_fraction = 0.25 if model.family in HYBRID_FAMILIES else 1.0
    fraction = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", default_fraction))
    if theta is None or float(theta) != int(theta):
        raise ValueError(f"{model.path}/config.json: rope_theta {theta!r}: an integer is needed")
    return float(theta), float(fraction)


def _refuse_unsupported(model: HFModel) -> None:
    cfg, where = model.text_config, f"{model.path}/config.json"
    problems = []
    if cfg.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act {cfg['hidden_act']!r} (only silu: SwiGLU)")
    if cfg.get("attention_bias"):
        problems.append("attention_bias true")
    if cfg.get("use_sliding_window"):
        problems.append("use_sliding_window true")
    if model.family not in MOE_FAMILIES and (cfg.get("num_experts") or cfg.get("num_local_experts")):
        problems.append("a mixture of experts (num_experts) outside Qwen3-MoE and Qwen3.5-MoE")
    if model.family != "qwen3_5_moe" and cfg.get("shared_expert_intermediate_size"):
        problems.append("shared_expert_intermediate_size (a shared expert) outside Qwen3.5-MoE")
    if problems:
        raise ValueError(f"{where}: not supported: " + "; ".join(problems))


def megatron_flags(model: HFModel) -> dict:
    """Megatron argument destinations -> values that build this checkpoint's architecture."""
    _refuse_unsupported(model)
    cfg, positive = model.text_config, model.positive
    theta, rotary_fraction = _rope(model)
    hidden, heads, kv_heads = (positive(key, int) for key in
                               ("hidden_size", "num_attention_heads", "num_key_value_heads"))
    # Qwen3.5-MoE has no dense MLP; Megatron's --ffn-hidden-size is then the experts' width
    dense_ffn = "intermediate_size" if model.family != "qwen3_5_moe" else "moe_intermediate_size"
    flags = dict(
        hidden_size=hidden,
        ffn_hidden_size=positive(dense_ffn, int),
        num_attention_heads=heads,
        group_query_attention=kv_heads != heads,
        num_query_groups=kv_heads,
        kv_channels=positive("head_dim", int) if cfg.get("head_dim") is not None else hidden // heads,
        max_position_embeddings=positive("max_position_embeddings", int),
        position_embedding_type="rope",
        rotary_base=int(theta),  # Megatron's --rotary-base is an int
        rotary_percent=rotary_fraction,
        normalization="RMSNorm",
        layernorm_epsilon=positive("rms_norm_eps", float),
        qk_layernorm=True,
        swiglu=True,
        add_bias_linear=False,
        add_qkv_bias=False,
        untie_embeddings_and_output_weights=not cfg.get("tie_word_embeddings", False),
        vocab_size=model.vocab_size,
    )
    if model.family in ("qwen3", "qwen3_moe"):
        flags.update(num_layers=positive("num_hidden_layers", int), layernorm_zero_centered_gamma=False,
                     attention_output_gate=False)
        if model.family == "qwen3_moe":
            flags.update(_qwen3_moe_flags(model))
    else:
        flags.update(_qwen3_5_flags(model))
        if model.family == "qwen3_5_moe":
            flags.update(_qwen3_5_moe_flags(model))
    return flags


def moe_layers(model: HFModel) -> list[bool]:
    """Qwen3-MoE: which layers have experts (transformers' rule: every `decoder_sparse_step`-th,
    counting from 1, unless listed in `mlp_only_layers`)."""
    cfg, layers = model.text_config, model.positive("num_hidden_layers", int)
    step = model.positive("decoder_sparse_step", int) if "decoder_sparse_step" in cfg else 1
    dense = set(cfg.get("mlp_only_layers") or [])
    return [i not in dense and (i + 1) % step == 0 for i in range(layers)]


def _router_flags(model: HFModel, normalized_topk: bool) -> dict:
    """The router: top-k of the logits then a softmax over the k is the normalized top-k of the
    softmax; without normalization, the softmax over every expert, then the top-k."""
    return dict(
        num_experts=model.num_experts,
        moe_router_topk=model.positive("num_experts_per_tok", int),
        moe_ffn_hidden_size=model.positive("moe_intermediate_size", int),
        moe_router_pre_softmax=not normalized_topk,
        moe_router_score_function="softmax",
    )


def _qwen3_moe_flags(model: HFModel) -> dict:
    return dict(_router_flags(model, model.text_config.get("norm_topk_prob", False)),
                moe_layer_freq=[int(moe) for moe in moe_layers(model)])


def _qwen3_5_moe_flags(model: HFModel) -> dict:
    """Every layer's experts, always the normalized top-k; the shared expert's output times the
    sigmoid of its gate (megatron-core's --moe-shared-expert-gate)."""
    return dict(_router_flags(model, normalized_topk=True),
                moe_shared_expert_intermediate_size=model.positive("shared_expert_intermediate_size", int),
                moe_shared_expert_gate=True)


def _qwen3_5_flags(model: HFModel) -> dict:
    cfg = model.text_config
    symbols = {"linear_attention": "G", "full_attention": "*"}
    unknown = sorted(set(model.layer_types) - set(symbols))
    if unknown:
        raise ValueError(f"{model.path}/config.json: layer_types {unknown} are not supported")
    mlp = "E" if model.family == "qwen3_5_moe" else "-"
    return dict(
        hybrid_layer_pattern="".join(symbols[kind] + mlp for kind in model.layer_types),
        layernorm_zero_centered_gamma=True,  # Qwen3.5's RMSNorm scales by (1 + weight)
        attention_output_gate=cfg.get("attn_output_gate", True),
        **{key: model.positive(key, int) for key in ("linear_num_key_heads", "linear_num_value_heads",
                                                      "linear_key_head_dim", "linear_value_head_dim",
                                                      "linear_conv_kernel_dim")},
    )
