"""Hugging Face checkpoints in and out, on CPU: tiny random Qwen3 and Qwen3.5 models written by
`transformers` in the test, imported into this package's Megatron model (built from the flags
their config implies), compared with transformers' own forward, and exported back.

The logits comparison is fp32 and not a bitwise claim: the two forwards use different kernels
(a torch reference for FlashAttention, fla's recurrent GDN kernel in the Triton interpreter vs
transformers' chunked torch rule, different RMSNorm and rope code), so they agree to rounding,
checked at 1e-5 absolute (seen: at most 1e-6 on logits of order 1). The round trip (import,
export) is bitwise."""

import os
import sys

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hf_checkpoints import save_qwen3, save_qwen3_moe, save_qwen35  # noqa: E402

from .conftest import torch_varlen_attention  # noqa: E402

from megatron_rl_bi import bi  # noqa: E402
from megatron_rl_bi.checkpoints.hf import check_hf_weights, export_hf, load_hf_weights, read_hf_model  # noqa: E402
from megatron_rl_bi.config import parse_rl_args  # noqa: E402
from megatron_rl_bi.packing import pack_sequences  # noqa: E402

LOGITS_ATOL = 1e-5
SEQUENCES = [[1, 3, 48, 49, 9, 46, 10, 2, 1, 4], [7, 8, 9], [20, 21, 22, 23, 24, 25, 26]]


def _transformers_gdn_in_torch(monkeypatch):
    """transformers swaps in fla's kernels where fla is installed; the reference side of the
    comparison is its own torch code (fla's chunked kernels do not run in the interpreter)."""
    from transformers.models.qwen3_5 import modeling_qwen3_5
    from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe

    for module in (modeling_qwen3_5, modeling_qwen3_5_moe):
        for name in ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule",
                     "causal_conv1d_fn", "causal_conv1d_update"):
            function = getattr(module, name)
            monkeypatch.setattr(module, name, getattr(function, "__wrapped__", function))


@pytest.fixture
def cpu_megatron(gloo_group, single_config_autotune, monkeypatch):
    """Megatron model construction and forward on CPU: the current device is the CPU, attention
    runs the torch reference, GDN runs fla's recurrent kernel (the chunked one has no Triton
    interpreter path)."""
    from megatron.core import parallel_state

    from megatron_rl_bi.attention import flash
    from megatron_rl_bi.models.gdn import SwitchedGatedDeltaNet

    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")
    monkeypatch.setattr(flash, "flash_varlen_function", lambda version: torch_varlen_attention)
    monkeypatch.setattr(SwitchedGatedDeltaNet, "_recurrent", staticmethod(lambda decode_only: True))
    _transformers_gdn_in_torch(monkeypatch)
    parallel_state.initialize_model_parallel(1, 1)
    yield
    parallel_state.destroy_model_parallel()


def build(path: str, *flags: str):
    from megatron_rl_bi.models.build import build_model

    args = parse_rl_args(["--hf-checkpoint", path, "--use-cpu-initialization", "--no-initialization",
                          "--transformer-impl", "local", "--flash-attention-version", "4", *flags])
    with bi.batch_invariant(False):
        model = build_model(args, args.vocab_size)
    return model, args


def our_logits(model, sequences):
    batch = pack_sequences(sequences)
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, position_ids=batch.position_ids,
                       attention_mask=None, packed_seq_params=batch.packed_seq_params())[0]
    return torch.split(logits, batch.sequence_lengths)


def hf_logits(path, sequences):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        return [model(torch.tensor([s])).logits[0] for s in sequences]


def assert_same_model(path, model, vocab_size):
    for ours, theirs in zip(our_logits(model, SEQUENCES), hf_logits(path, SEQUENCES)):
        assert ours.shape[-1] >= vocab_size
        assert (ours[:, vocab_size:] == 0).all()  # padded vocabulary rows are zero
        assert (ours[:, :vocab_size] - theirs).abs().max().item() < LOGITS_ATOL


@pytest.mark.parametrize("tied", [True, False])
def test_qwen3_import_matches_transformers_and_round_trips(tmp_path, cpu_megatron, tied):
    save_qwen3(str(tmp_path / "hf"), tied=tied)
    hf = read_hf_model(str(tmp_path / "hf"))
    model, args = build(hf.path)
    assert (args.num_layers, args.hidden_size, args.kv_channels, args.num_query_groups) == (2, 64, 16, 2)
    assert args.untie_embeddings_and_output_weights is not tied and args.qk_layernorm
    load_hf_weights(model, hf)
    assert_same_model(hf.path, model, hf.vocab_size)
    assert_round_trip(model, hf, tmp_path / "out")


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_qwen3_moe_import_matches_transformers_and_round_trips(tmp_path, cpu_megatron, norm_topk_prob):
    """Experts, router and the dense layer of `mlp_only_layers` in place; the router's top-k
    normalized (top-k of the logits, softmax over the k) or not (softmax over all, top-k)."""
    from safetensors.torch import load_file

    save_qwen3_moe(str(tmp_path / "hf"), norm_topk_prob=norm_topk_prob)
    assert "model.layers.0.mlp.experts.3.down_proj.weight" in load_file(str(tmp_path / "hf" / "model.safetensors"))
    hf = read_hf_model(str(tmp_path / "hf"))
    model, args = build(hf.path)
    assert (args.num_experts, args.moe_router_topk, args.moe_ffn_hidden_size, args.ffn_hidden_size) == (4, 2, 32, 96)
    assert args.moe_layer_freq == [1, 0, 1] and args.moe_router_pre_softmax is not norm_topk_prob
    load_hf_weights(model, hf)
    assert_same_model(hf.path, model, hf.vocab_size)
    assert_round_trip(model, hf, tmp_path / "out")


def assert_round_trip(model, hf, out_dir):
    from safetensors.torch import load_file

    export_hf(model, hf, str(out_dir))
    original = load_file(os.path.join(hf.path, "model.safetensors"))
    exported = load_file(os.path.join(out_dir, "model.safetensors"))
    text = {k.replace("model.language_model.", "model."): v for k, v in original.items()
            if not k.startswith("mtp.")}
    assert sorted(exported) == sorted(text)
    for name, tensor in text.items():
        assert torch.equal(exported[name], tensor), name
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        assert os.path.isfile(os.path.join(out_dir, name))


@pytest.mark.parametrize("nested,tied", [(False, False), (True, False), (False, True)])
def test_qwen35_import_matches_transformers_and_round_trips(tmp_path, cpu_megatron, nested, tied):
    mtp = {"mtp.fc.weight": torch.zeros(2, 2)}  # an MTP head: skipped with a note
    save_qwen35(str(tmp_path / "hf"), nested=nested, extra_tensors=mtp, tied=tied)
    hf = read_hf_model(str(tmp_path / "hf"))
    model, args = build(hf.path)
    assert args.hybrid_layer_pattern == "G-G-G-*-"
    assert args.attention_output_gate and args.layernorm_zero_centered_gamma
    assert args.rotary_percent == 0.25 and args.kv_channels == 32
    load_hf_weights(model, hf)
    reference = hf.path
    if nested:  # transformers reads the text model of the exported (text-only) directory
        export_hf(model, hf, str(tmp_path / "text"))
        reference = str(tmp_path / "text")
    assert_same_model(reference, model, hf.vocab_size)
    assert_round_trip(model, hf, tmp_path / "out")


@pytest.mark.parametrize("nested", [False, True])
def test_qwen35_moe_import_matches_transformers_and_round_trips(tmp_path, cpu_megatron, nested):
    """Every MLP a mixture of experts ('E' after each mixer): experts, router, and the shared
    expert with its sigmoid gate in place (weights of order one, so a swap shows)."""
    from safetensors.torch import load_file

    save_qwen35(str(tmp_path / "hf"), nested=nested, moe=True)
    names = load_file(str(tmp_path / "hf" / "model.safetensors"))
    prefix = "model.language_model." if nested else "model."
    assert {f"{prefix}layers.3.mlp.experts.3.down_proj.weight",
            f"{prefix}layers.3.mlp.shared_expert_gate.weight"} <= set(names)
    hf = read_hf_model(str(tmp_path / "hf"))
    model, args = build(hf.path)
    assert args.hybrid_layer_pattern == "GEGEGE*E"
    assert (args.num_experts, args.moe_router_topk, args.moe_ffn_hidden_size) == (4, 2, 32)
    assert args.moe_shared_expert_intermediate_size == 48 and args.moe_shared_expert_gate
    assert not args.moe_router_pre_softmax
    load_hf_weights(model, hf)
    reference = hf.path
    if nested:
        export_hf(model, hf, str(tmp_path / "text"))
        reference = str(tmp_path / "text")
    assert_same_model(reference, model, hf.vocab_size)
    assert_round_trip(model, hf, tmp_path / "out")


def test_contradicting_flags_are_named(tmp_path):
    save_qwen3(str(tmp_path / "hf"))
    with pytest.raises(ValueError) as info:
        parse_rl_args(["--hf-checkpoint", str(tmp_path / "hf"), "--hidden-size", "128",
                       "--num-query-groups", "4"])
    message = str(info.value)
    assert "--hidden-size (hidden_size=128) contradicts" in message and "hidden_size=64" in message
    assert "--num-query-groups (num_query_groups=4)" in message


def test_unsupported_checkpoints_fail_before_any_weight_is_read(tmp_path):
    import json

    save_qwen3(str(tmp_path / "hf"))
    config_path = tmp_path / "hf" / "config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, "hidden_act": "gelu", "num_experts": 8}))
    with pytest.raises(ValueError, match="hidden_act 'gelu'.*mixture of experts"):
        parse_rl_args(["--hf-checkpoint", str(tmp_path / "hf")])
    config_path.write_text(json.dumps({**config, "model_type": "llama"}))
    with pytest.raises(ValueError, match="model_type 'llama' is not supported"):
        read_hf_model(str(tmp_path / "hf"))
    with pytest.raises(ValueError, match="no config.json"):
        read_hf_model(str(tmp_path / "nowhere"))
    config_path.write_text('{\n  "model_type": "qwen3",\n  "vocab_size": ,\n}\n')
    with pytest.raises(ValueError, match=r"config.json:3: not JSON \(Expecting value\)"):
        read_hf_model(str(tmp_path / "hf"))
    config_path.write_text("[]")
    with pytest.raises(ValueError, match="config.json:1: expected a JSON object, got list"):
        read_hf_model(str(tmp_path / "hf"))


def test_a_bad_shard_index_names_the_file(tmp_path):
    from megatron_rl_bi.checkpoints.hf.files import INDEX, SafetensorsReader

    (tmp_path / INDEX).write_text('{"metadata": {}}')
    with pytest.raises(ValueError, match=f'{INDEX}: no "weight_map" object'):
        SafetensorsReader(str(tmp_path))
    (tmp_path / INDEX).write_text('{"weight_map": {"a": "model-1.safetensors",}}')
    with pytest.raises(ValueError, match=f"{INDEX}:1: not JSON"):
        SafetensorsReader(str(tmp_path))
    (tmp_path / INDEX).unlink()
    with pytest.raises(ValueError, match=f"neither {INDEX} nor model.safetensors"):
        SafetensorsReader(str(tmp_path))
    (tmp_path / "model.safetensors").write_bytes(b"cut")
    with pytest.raises(ValueError, match="model.safetensors: not a safetensors file"):
        SafetensorsReader(str(tmp_path))


@pytest.mark.parametrize("family", ["qwen3", "qwen3-tied", "qwen3-moe", "qwen3.5", "qwen3.5-nested", "qwen3.5-moe"])
def test_the_pre_flight_passes_the_weights_transformers_writes(tmp_path, family):
    save = {"qwen3": lambda p: save_qwen3(p, tied=False), "qwen3-tied": save_qwen3, "qwen3-moe": save_qwen3_moe,
            "qwen3.5": save_qwen35, "qwen3.5-nested": lambda p: save_qwen35(p, nested=True),
            "qwen3.5-moe": lambda p: save_qwen35(p, moe=True)}[family]
    save(str(tmp_path / "hf"))
    check_hf_weights(read_hf_model(str(tmp_path / "hf")))


def test_the_pre_flight_refuses_weights_missing_unreadable_or_incomplete(tmp_path):
    """Each passed `--launch-check` before: weights left out (--config-only), a garbled file, a
    shard the index names but that is not there, and a tensor the architecture needs absent."""
    import json

    from safetensors.torch import load_file, save_file

    save_qwen3(str(tmp_path / "hf"), tied=False)
    hf = read_hf_model(str(tmp_path / "hf"))
    weights = tmp_path / "hf" / "model.safetensors"
    tensors = load_file(weights)
    weights.rename(tmp_path / "kept.safetensors")
    with pytest.raises(ValueError, match="neither model.safetensors.index.json nor model.safetensors"):
        check_hf_weights(hf)
    weights.write_bytes(b"not a safetensors file at all")
    with pytest.raises(ValueError, match="model.safetensors: not a safetensors file"):
        check_hf_weights(hf)
    weights.unlink()
    index = {"weight_map": {name: "model-00001-of-00002.safetensors" for name in tensors}}
    index["weight_map"]["lm_head.weight"] = "model-00002-of-00002.safetensors"
    (tmp_path / "hf" / "model.safetensors.index.json").write_text(json.dumps(index))
    save_file({k: v for k, v in tensors.items() if k != "lm_head.weight"},
              tmp_path / "hf" / "model-00001-of-00002.safetensors")
    with pytest.raises(ValueError, match="names model-00002-of-00002.safetensors, which is not there"):
        check_hf_weights(hf)
    save_file({"lm_head.weight": tensors["lm_head.weight"]}, tmp_path / "hf" / "model-00002-of-00002.safetensors")
    check_hf_weights(hf)  # the two shards hold every tensor
    del index["weight_map"]["model.layers.1.mlp.up_proj.weight"]
    (tmp_path / "hf" / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"no tensor 'model.layers.1.mlp.up_proj.weight' \(1 of the \d+ its "
                                         r"config.json's architecture needs are missing\)"):
        check_hf_weights(hf)
    index["weight_map"]["model.layers.1.mlp.up_proj.weight"] = "model-00002-of-00002.safetensors"
    (tmp_path / "hf" / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"model-00002-of-00002.safetensors: no tensor "
                                         r"'model.layers.1.mlp.up_proj.weight' \(1 missing\), which"):
        check_hf_weights(hf)


def test_an_export_replaces_nothing_but_an_earlier_export(tmp_path):
    from safetensors.torch import load_file

    from megatron_rl_bi.checkpoints.hf.files import write_checkpoint

    source = tmp_path / "source"
    source.mkdir()
    (source / "tokenizer.json").write_text("{}")
    out = tmp_path / "out" / "iter_0000005"
    for value in (1.0, 2.0):  # a periodic export written again replaces the earlier one
        write_checkpoint(str(out), {"w": torch.full((2,), value)}, {"model_type": "qwen3"}, str(source))
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors", "tokenizer.json"]
    assert torch.equal(load_file(str(out / "model.safetensors"))["w"], torch.full((2,), 2.0))
    (tmp_path / "empty").mkdir()
    write_checkpoint(str(tmp_path / "empty"), {"w": torch.ones(2)}, {}, str(source))

    run = tmp_path / "run"
    (run / "important").mkdir(parents=True)
    (run / "config.json").write_text("{}")
    (run / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match=r"^--save-hf .*run: exists and holds files that are not an HF "
                                         r"export \(important/, notes.txt\); choose a new or empty"):
        write_checkpoint(str(run), {"w": torch.ones(2)}, {}, str(source))
    assert sorted(os.listdir(run)) == ["config.json", "important", "notes.txt"]
    assert not os.path.exists(str(run) + ".tmp")
    with pytest.raises(ValueError, match="notes.txt: exists and is not a directory"):
        write_checkpoint(str(run / "notes.txt"), {"w": torch.ones(2)}, {}, str(source))


def _convert_hf(monkeypatch, *argv: str):
    """tools/convert_hf.py's main on `argv`, failing the test if it gets as far as the model."""
    import importlib.util

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                        "tools", "convert_hf.py")
    spec = importlib.util.spec_from_file_location("convert_hf", path)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    for name in ("validate_installed_kernels", "initialize_distributed", "build_model"):
        monkeypatch.setattr(tool, name, lambda *a, name=name: pytest.fail(f"reached {name}"))
    monkeypatch.setattr(sys, "argv", ["convert_hf.py", *argv])
    tool.main()


def test_convert_hf_names_the_missing_flags_before_megatron_checks_the_model(tmp_path, monkeypatch):
    with pytest.raises(SystemExit, match=r"^convert_hf.py: error: import needs --hf-checkpoint DIR .*; --save OUT"):
        _convert_hf(monkeypatch, "import")
    with pytest.raises(SystemExit, match=r"^convert_hf.py: error: verify needs --hf-checkpoint DIR \("):
        _convert_hf(monkeypatch, "verify", "--bf16")
    save_qwen3(str(tmp_path / "hf"))
    (tmp_path / "recipe.yaml").write_text(f"hf-checkpoint: {tmp_path / 'hf'}\n")  # a recipe gives it
    with pytest.raises(SystemExit, match=r"^convert_hf.py: error: "
                                         r"export needs --load RUN/checkpoints .*; --save-hf OUT"):
        _convert_hf(monkeypatch, "export", "--recipe", str(tmp_path / "recipe.yaml"))


def test_convert_hf_checks_its_directories_before_building_the_model(tmp_path, monkeypatch):
    save_qwen3(str(tmp_path / "hf"))
    run = tmp_path / "run"
    (run / "important").mkdir(parents=True)
    (tmp_path / "checkpoint").mkdir()
    hf = ["--hf-checkpoint", str(tmp_path / "hf")]
    with pytest.raises(SystemExit, match=r"^convert_hf.py: error: "
                                         r"--save .*run: exists and holds files that are not a torch_dist "
                                         r"checkpoint \(important/\)"):
        _convert_hf(monkeypatch, "import", *hf, "--save", str(run))  # --save-interval: the tool's own 1
    with pytest.raises(SystemExit, match=r"^convert_hf.py: error: --load .*checkpoint: neither a dist checkpoint"):
        _convert_hf(monkeypatch, "export", *hf, "--load", str(tmp_path / "checkpoint"), "--save-hf", str(run))
    (tmp_path / "checkpoint" / "metadata.json").write_text("{}")
    with pytest.raises(SystemExit, match=r"^convert_hf.py: error: "
                                         r"--save-hf .*run: exists and holds files that are not an HF "
                                         r"export \(important/\)"):
        _convert_hf(monkeypatch, "export", *hf, "--load", str(tmp_path / "checkpoint"), "--save-hf", str(run))
    assert os.listdir(run) == ["important"]
    with pytest.raises(SystemExit, match=r"^convert_hf.py: error: --save-hf .*hf: is --hf-checkpoint, the source"):
        _convert_hf(monkeypatch, "export", *hf, "--load", str(tmp_path / "checkpoint"), "--save-hf",
                    str(tmp_path / "hf"))
