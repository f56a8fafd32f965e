"""Bad flags fail before any GPU work, with one error naming each flag."""

import pytest

from megatron_rl_bi.config import parse_args

MODEL = [
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
    "--seq-length", "128", "--max-position-embeddings", "128", "--micro-batch-size", "1",
]


def errors_for(*flags):
    with pytest.raises(ValueError) as info:
        parse_args(MODEL + list(flags))
    return str(info.value)


def test_bi_without_flash_attention_version():
    assert "--batch-invariant-mode needs --flash-attention-version 3 or 4" in errors_for(
        "--batch-invariant-mode"
    )


def test_bi_with_fa2():
    message = errors_for("--batch-invariant-mode", "--flash-attention-version", "2")
    assert "--flash-attention-version 2 cannot be used with --batch-invariant-mode" in message


def test_pinned_generation_not_installed(monkeypatch):
    import megatron_rl_bi.attention.flash as flash

    def missing():
        raise ImportError("flash_attn_3 is not importable")

    monkeypatch.setattr(flash, "_fa3_varlen", missing)
    from megatron_rl_bi.config import validate_installed_kernels

    args = parse_args(MODEL + ["--batch-invariant-mode", "--flash-attention-version", "3",
                               "--transformer-impl", "local"])  # parsing needs no kernel installed
    with pytest.raises(ValueError) as info:
        validate_installed_kernels(args)
    message = str(info.value)
    assert "--flash-attention-version 3 needs FlashAttention-3" in message
    assert "hopper" in message  # the install hint


def test_tp_and_cp_with_bi():
    message = errors_for(
        "--batch-invariant-mode", "--flash-attention-version", "4",
        "--tensor-model-parallel-size", "2", "--context-parallel-size", "2",
    )
    assert "--tensor-model-parallel-size 2" in message
    assert "--context-parallel-size 2 with --batch-invariant-mode" in message


def test_tp_without_bi_is_refused_too():
    assert "--tensor-model-parallel-size 2" in errors_for("--tensor-model-parallel-size", "2")


def test_dropout_with_bi_names_each_flag():
    message = errors_for(
        "--batch-invariant-mode", "--flash-attention-version", "4",
        "--attention-dropout", "0.1", "--hidden-dropout", "0.05",
    )
    assert "--attention-dropout 0.1: training attention runs without dropout" in message
    assert "--hidden-dropout 0.05 with --batch-invariant-mode" in message


def test_attention_dropout_is_refused_in_default_mode_too():
    assert "--attention-dropout 0.1: training attention" in errors_for("--attention-dropout", "0.1")


def test_installed_kernels_are_checked_in_default_mode(monkeypatch):
    """Training attention needs FA 3 or 4 in every mode; checked before GPU work (not at parse
    time, so machines without FlashAttention can parse a run's flags)."""
    from megatron_rl_bi import compat
    from megatron_rl_bi.config.megatron_args import validate_installed_kernels

    monkeypatch.setattr(compat, "transformer_engine_installed", lambda: False)
    args = parse_args(MODEL + ["--transformer-impl", "local"])
    args.transformer_impl = "transformer_engine"
    with pytest.raises(ValueError) as info:
        validate_installed_kernels(args)
    assert "training attention needs FlashAttention 3 or 4 (--flash-attention-version)" in str(info.value)
    assert "--transformer-impl transformer_engine: TransformerEngine is not installed" in str(info.value)
    args.flash_attention_version = 4  # not installed on this machine
    with pytest.raises(ValueError, match="--flash-attention-version 4 needs FlashAttention-4"):
        validate_installed_kernels(args)


@pytest.fixture
def fa3_without_head_dim_256(monkeypatch):
    """An installed FA3 wheel built with FLASHATTENTION_DISABLE_HDIM256 (as the H200 kit builds it)."""
    import sys
    import types

    import megatron_rl_bi.attention as attention

    monkeypatch.setattr(attention, "flash_varlen_function", lambda version: None)
    config = types.SimpleNamespace(CONFIG={"build_flags": {"FLASHATTENTION_DISABLE_HDIM256": True,
                                                           "FLASHATTENTION_DISABLE_HDIM96": False}})
    monkeypatch.setitem(sys.modules, "flash_attn_config", config)


def test_fa3_kernel_head_dims(fa3_without_head_dim_256):
    from megatron_rl_bi.attention import fa3_missing_head_dim

    assert [fa3_missing_head_dim(d) for d in (64, 80, 128, 129, 192, 193, 256)] == [
        None, None, None, None, None, 256, 256]


def test_fa3_built_without_the_models_head_dim(fa3_without_head_dim_256):
    from megatron_rl_bi.config.megatron_args import validate_installed_kernels

    args = parse_args(MODEL + ["--transformer-impl", "local", "--flash-attention-version", "3"])
    validate_installed_kernels(args)  # head dim 16
    args.kv_channels = 256
    with pytest.raises(ValueError, match="built without head dim 256 .FLASHATTENTION_DISABLE_HDIM256., "
                                         "which this model's head dim 256 needs"):
        validate_installed_kernels(args)


def test_layernorm_with_bi():
    message = errors_for(
        "--batch-invariant-mode", "--flash-attention-version", "4", "--normalization", "LayerNorm"
    )
    assert "--normalization LayerNorm with --batch-invariant-mode" in message


def test_defaults_are_parity_safe():
    args = parse_args(MODEL)
    assert args.apply_rope_fusion is False
    assert args.hidden_dropout == 0.0 and args.attention_dropout == 0.0
    assert args.normalization == "RMSNorm"
    assert args.attention_backend.name == "flash"


@pytest.mark.parametrize("te", [True, False])
def test_gradient_accumulation_fusion_off_without_apex(monkeypatch, te):
    """With TE but without APEX's fused weight-gradient extension, megatron-core's default
    (fusion on) fails at model build: the default follows the extension."""
    from megatron_rl_bi import compat

    monkeypatch.setattr(compat, "transformer_engine_installed", lambda: te)
    monkeypatch.setattr(compat, "apex_gradient_accumulation_fusion_installed", lambda: False)
    assert parse_args(MODEL + ["--transformer-impl", "local"]).gradient_accumulation_fusion is False
    monkeypatch.setattr(compat, "apex_gradient_accumulation_fusion_installed", lambda: True)
    assert parse_args(MODEL + ["--transformer-impl", "local"]).gradient_accumulation_fusion is True


def test_save_interval_is_named_before_megatrons_bare_assert(tmp_path):
    assert "--save needs --save-interval N" in errors_for("--save", str(tmp_path))
    message = errors_for("--save", str(tmp_path), "--save-interval", "-2")
    assert "--save-interval must be >= 1 with --save, got -2" in message
    assert parse_args(MODEL + ["--save", str(tmp_path), "--save-interval", "3"]).save_interval == 3


def test_megatron_cores_own_refusals_are_errors_that_say_what(monkeypatch):
    """Its checks are asserts: without a message the failed line, with one the message."""
    import megatron.training.arguments as megatron_arguments

    from megatron_rl_bi.config import parse_args

    with pytest.raises(ValueError, match=r"^megatron-core refuses these arguments: "
                                         r"assert args.micro_batch_size is not None$"):
        parse_args(["--hidden-size", "64", "--num-layers", "2"])

    def validate_args(args):
        raise AssertionError("either num-layers or encoder-num-layers should be specified")

    monkeypatch.setattr(megatron_arguments, "validate_args", validate_args)
    with pytest.raises(ValueError, match="^megatron-core refuses these arguments: either num-layers or "
                                         "encoder-num-layers should be specified$"):
        parse_args(MODEL)


def _flash_installed(monkeypatch, *versions):
    """Only these FlashAttention generations import."""
    import megatron_rl_bi.attention as attention

    def varlen(version):
        if version not in versions:
            raise ImportError(f"--flash-attention-version {version} needs FlashAttention-{version}: "
                              "not installed here")
        return lambda *a, **k: None

    monkeypatch.setattr(attention, "flash_varlen_function", varlen)


@pytest.mark.parametrize("installed, picked", [((3, 4), 4), ((3,), 3), ((4,), 4)])
def test_default_mode_runs_the_installed_generation_and_says_so(monkeypatch, capsys, installed, picked):
    from megatron_rl_bi.config import validate_installed_kernels

    _flash_installed(monkeypatch, *installed)
    args = parse_args(MODEL + ["--transformer-impl", "local"])
    assert args.flash_attention_version is None
    validate_installed_kernels(args)
    assert args.flash_attention_version == picked
    assert f"--flash-attention-version not given: running {picked}, the installed generation" in capsys.readouterr().out


def test_default_mode_without_flash_attention_names_what_is_missing(monkeypatch):
    from megatron_rl_bi.config import validate_installed_kernels

    _flash_installed(monkeypatch)
    args = parse_args(MODEL + ["--transformer-impl", "local"])
    with pytest.raises(ValueError, match=r"(?s)training attention needs FlashAttention 3 or 4 "
                                         r"\(--flash-attention-version\), and neither is installed:\n"
                                         r".*FlashAttention-4: not installed here\n.*FlashAttention-3: not installed"):
        validate_installed_kernels(args)


def test_bi_mode_keeps_requiring_the_pin(monkeypatch):
    from megatron_rl_bi.config import validate_installed_kernels
    from megatron_rl_bi.config.megatron_args import pick_flash_attention_version

    _flash_installed(monkeypatch, 4)
    assert "--batch-invariant-mode needs --flash-attention-version 3 or 4" in errors_for("--batch-invariant-mode")
    args = parse_args(MODEL + ["--transformer-impl", "local", "--flash-attention-version", "4"])
    args.batch_invariant_mode, args.flash_attention_version = True, None
    pick_flash_attention_version(args)
    assert args.flash_attention_version is None  # nothing picked in BI mode
    with pytest.raises(ValueError, match="--batch-invariant-mode needs --flash-attention-version"):
        validate_installed_kernels(args)


def test_a_ci_machine_without_flash_attention_names_both_generations():
    """The real import, no stand-in: this CPU machine has neither generation installed."""
    from megatron_rl_bi.config import validate_installed_kernels

    args = parse_args(MODEL + ["--transformer-impl", "local"])
    try:
        validate_installed_kernels(args)
    except ValueError as error:
        assert "FlashAttention-4" in str(error) and "FlashAttention-3" in str(error)
    else:
        assert args.flash_attention_version in (3, 4)  # a machine with one installed picks it


MOE = ("--num-experts", "4", "--moe-router-topk", "2")


@pytest.mark.parametrize("flags, error", [
    (("--expert-model-parallel-size", "2"), "--expert-model-parallel-size 2: MoE runs with expert parallelism 1"),
    (("--expert-tensor-parallel-size", "2"), "--expert-tensor-parallel-size 2: MoE runs with expert parallelism 1"),
    (("--moe-token-dispatcher-type", "alltoall"), "--moe-token-dispatcher-type alltoall: at expert parallelism 1"),
    (("--moe-grouped-gemm",), "--moe-grouped-gemm: not supported with --num-experts"),
    (("--moe-permute-fusion",), "--moe-permute-fusion: not supported"),
    (("--moe-router-fusion",), "--moe-router-fusion: not supported"),
    (("--moe-pad-experts-for-cuda-graph-inference",), "--moe-pad-experts-for-cuda-graph-inference: not supported"),
    (("--cuda-graph-impl", "local", "--inference-cuda-graph-scope", "block"),
     "--cuda-graph-impl local with --num-experts in default mode: megatron-core's dispatcher"),
    (("--moe-shared-expert-intermediate-size", "8"), "--moe-shared-expert-intermediate-size with biases"),
    (("--moe-enable-routing-replay", "--inference-dynamic-batching-async-sched-mode", "async"),
     "--moe-enable-routing-replay with --inference-dynamic-batching-async-sched-mode async"),
])
def test_a_moe_run_that_cannot_work_is_refused_naming_the_flag(flags, error):
    assert error in errors_for(*MOE, *flags)


@pytest.mark.parametrize("flags, error", [
    (("--moe-expert-capacity-factor", "1.0"), "--moe-expert-capacity-factor with --batch-invariant-mode"),
    (("--moe-router-load-balancing-type", "sinkhorn"), "--moe-router-load-balancing-type sinkhorn with --batch-invariant-mode"),
    (("--moe-input-jitter-eps", "0.01"), "--moe-input-jitter-eps with --batch-invariant-mode"),
    (("--moe-router-force-load-balancing",), "--moe-router-force-load-balancing with --batch-invariant-mode"),
])
def test_what_makes_routing_depend_on_the_batch_is_refused_in_bi_mode_only(flags, error):
    bi_flags = ("--batch-invariant-mode", "--flash-attention-version", "4")
    assert error in errors_for(*MOE, *bi_flags, *flags)
    parse_args(MODEL + [*MOE, *flags])  # default mode takes them


def test_engine_graphs_with_experts_are_taken_in_bi_mode_without_routing_records():
    graphs = ("--cuda-graph-impl", "local", "--inference-cuda-graph-scope", "block")
    bi_flags = ("--batch-invariant-mode", "--flash-attention-version", "4")
    parse_args(MODEL + [*MOE, *graphs, *bi_flags])
    assert ("--cuda-graph-impl local with --moe-enable-routing-replay: the routers record their choices "
            "in Python, which a replayed graph skips") in errors_for(*MOE, *graphs, *bi_flags,
                                                                      "--moe-enable-routing-replay")


def test_routing_replay_without_experts_is_refused():
    assert "--moe-enable-routing-replay without --num-experts" in errors_for("--moe-enable-routing-replay")


def test_a_plain_moe_run_is_accepted_in_both_modes():
    from megatron_rl_bi.config.megatron_args import moe_errors

    args = parse_args(MODEL + [*MOE, "--moe-shared-expert-intermediate-size", "8", "--disable-bias-linear",
                               "--moe-enable-routing-replay"])
    assert moe_errors(args, batch_invariant=True) == moe_errors(args, batch_invariant=False) == []
