"""The BI switch is atomic and complete without TransformerEngine (CPU: only dispatch is checked,
the Triton kernels themselves run on the GPU)."""

import pytest
import torch
from megatron.core.transformer.custom_layers import batch_invariant_kernels as mcore_bik

from megatron_rl_bi import bi, compat
from megatron_rl_bi.bi import gemm, log_softmax, mean, rmsnorm


@pytest.fixture
def mm_calls(monkeypatch, cpu_dispatch):
    """Records calls that reach megatron-core's BI mm override (stands in for the GPU kernel)."""
    calls = []

    def recording_mm(a, b):
        calls.append(a.shape)
        return torch.zeros(a.shape[0], b.shape[1], dtype=a.dtype)

    monkeypatch.setattr(mcore_bik, "mm_batch_invariant", recording_mm)
    yield calls
    bi.disable()


def test_enable_routes_mm_and_disable_restores(mm_calls):
    a, b = torch.randn(3, 4), torch.randn(4, 5)
    bi.enable()
    assert bi.enabled()
    assert torch.equal(torch.mm(a, b), torch.zeros(3, 5))
    assert mm_calls == [torch.Size([3, 4])]
    bi.disable()
    assert not bi.enabled()
    assert torch.allclose(torch.mm(a, b), a @ b.clone())
    assert len(mm_calls) == 1


def test_our_kernels_stand_in_for_megatron_cores_while_on(mm_calls):
    upstream_norm = mcore_bik.BatchInvariantRMSNormFn
    bi.enable()
    assert mcore_bik.matmul_persistent is gemm.matmul
    assert mcore_bik.BatchInvariantRMSNormFn is rmsnorm.BatchInvariantRMSNorm
    assert mcore_bik.log_softmax is log_softmax.log_softmax
    bi.disable()
    assert mcore_bik.matmul_persistent is gemm.MCORE_MATMUL
    assert mcore_bik.BatchInvariantRMSNormFn is upstream_norm
    assert mcore_bik.log_softmax is log_softmax.MCORE_LOG_SOFTMAX


def test_enable_is_idempotent(mm_calls):
    bi.enable()
    bi.enable()
    bi.disable()
    assert not bi.enabled()
    torch.mm(torch.randn(2, 2), torch.randn(2, 2))
    assert mm_calls == []


def test_failed_enable_rolls_everything_back(mm_calls, monkeypatch):
    def broken_te_patch():
        raise ImportError("transformer_engine is broken")

    monkeypatch.setattr(compat, "transformer_engine_installed", lambda: True)
    monkeypatch.setattr(mcore_bik, "_te_patch_for_batch_invariant", broken_te_patch)
    with pytest.raises(bi.BatchInvariantModeError, match="rolled back"):
        bi.enable()
    assert not bi.enabled() and mcore_bik.matmul_persistent is gemm.MCORE_MATMUL
    torch.mm(torch.randn(2, 2), torch.randn(2, 2))
    assert mm_calls == []


def test_context_manager_restores_previous_state(mm_calls):
    with bi.batch_invariant(True):
        assert bi.enabled()
        with bi.batch_invariant(False):
            assert not bi.enabled()
        assert bi.enabled()
    assert not bi.enabled()


@pytest.mark.skipif(compat.transformer_engine_installed(), reason="pins the no-TE upstream bug")
def test_upstream_enable_without_te_half_enables(mm_calls):
    """Why compat.transformer_engine_optional exists. When this fails, upstream fixed it."""
    with pytest.raises(ModuleNotFoundError):
        mcore_bik.enable_batch_invariant_mode()
    assert mcore_bik.is_batch_invariant_mode_enabled()  # half-enabled
    torch.mm(torch.randn(2, 2), torch.randn(2, 2))
    assert len(mm_calls) == 1  # the aten override stayed registered


def test_upstream_full_mean_returns_the_sum(cpu_dispatch):
    """Why bi.mean exists. When this fails, upstream fixed it."""
    x = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    with compat.transformer_engine_optional():
        mcore_bik.enable_batch_invariant_mode()
    try:
        assert x.mean().item() == 10.0
    finally:
        mcore_bik.disable_batch_invariant_mode()


def test_full_mean_divides_by_the_element_count_while_on(cpu_dispatch, monkeypatch):
    x = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    listed = []

    def recording_mean(input, dim, keepdim=False, dtype=None):
        listed.append(dim)
        return input[0]

    monkeypatch.setattr(mean, "_upstream_mean", recording_mean)
    with bi.batch_invariant(True):
        assert mcore_bik.mean_batch_invariant is mean.mean
        assert x.mean().item() == 2.5
        assert torch.mean(x, dim=None).item() == 2.5
        assert x.mean(dim=[], keepdim=True).shape == (1, 1)
        assert x.bfloat16().mean().dtype == torch.bfloat16
        assert x.mean(dtype=torch.float64).dtype == torch.float64
        x.mean(dim=(0, 1))  # listed dims: megatron-core's kernel, unchanged
    assert listed == [[0, 1]]
    assert mcore_bik.mean_batch_invariant is not mean.mean


def test_full_mean_of_integers_needs_a_float_dtype():
    ints = torch.tensor([1, 2, 4])
    with pytest.raises(TypeError, match="floating-point dtype"):
        mean.mean(ints, [])
    assert torch.equal(mean.mean(ints, [], dtype=torch.float32), torch.tensor(7.0) / 3)


# --- pieces left off (the parity doctor's ablation) ---

def test_a_piece_left_off_is_off_and_every_other_on(mm_calls):
    with bi.batch_invariant(True, without=["rmsnorm"]):
        assert bi.enabled() and not bi.enabled("rmsnorm") and bi.enabled("gemm") and bi.left_off("rmsnorm")
        with bi.batch_invariant(True):  # nested: all on, then the piece off again
            assert bi.enabled("rmsnorm")
        assert not bi.enabled("rmsnorm")
        with pytest.raises(ValueError, match="disable it before enabling with"):
            bi.enable()
    assert not bi.enabled() and not bi.enabled("rmsnorm") and not bi.left_off("rmsnorm")
    with bi.batch_invariant(True):
        assert bi.enabled("rmsnorm")
    with pytest.raises(ValueError, match=r"unknown batch-invariant pieces \['gemmm'\]"):
        bi.enable(without=["gemmm"])
    assert not bi.enabled()


def _log_softmax_calls(monkeypatch):
    calls = []

    def recording(input, dim, half_to_float):
        calls.append(input.shape)
        return torch.zeros_like(input)

    monkeypatch.setattr(mcore_bik, "_log_softmax_batch_invariant", recording)
    return calls


def test_gemm_left_off_runs_the_stock_mm_and_keeps_the_other_overrides(mm_calls, monkeypatch):
    softmax_calls = _log_softmax_calls(monkeypatch)
    a, b = torch.randn(3, 4), torch.randn(4, 5)
    with bi.batch_invariant(True, without=["gemm"]):
        assert torch.allclose(torch.mm(a, b), a @ b.clone())
        torch.log_softmax(a, dim=-1)
    assert mm_calls == [] and softmax_calls == [torch.Size([3, 4])]
    with bi.batch_invariant(True, without=["log_softmax"]):
        torch.mm(a, b)
        assert torch.allclose(torch.log_softmax(a, dim=-1), a - a.logsumexp(-1, keepdim=True))
    assert mm_calls == [torch.Size([3, 4])] and len(softmax_calls) == 1
    with bi.batch_invariant(True):  # all on again: both routed
        torch.mm(a, b)
        torch.log_softmax(a, dim=-1)
    assert len(mm_calls) == 2 and len(softmax_calls) == 2


def test_rmsnorm_left_off_runs_torchs_norm(cpu_dispatch, monkeypatch):
    from megatron_rl_bi.bi import ops

    calls = []
    monkeypatch.setattr(ops.BatchInvariantRMSNorm, "apply", lambda *args: calls.append(args) or args[0])
    x, weight = torch.randn(2, 8), torch.rand(8) + 0.5
    expected = torch.nn.functional.rms_norm(x, (8,), weight, 1e-6)
    with bi.batch_invariant(True, without=["rmsnorm", "mean"]):  # torch's CPU norm takes a mean
        assert torch.equal(bi.rms_norm(x, weight, 1e-6), expected)
    assert calls == []
    with bi.batch_invariant(True):
        bi.rms_norm(x, weight, 1e-6)
    assert len(calls) == 1


def test_fp32_logits_left_off_keeps_the_params_dtype(cpu_dispatch):
    logits = torch.randn(2, 6).bfloat16()
    assert bi.sampling_logits(logits, 0.5).dtype == torch.float32  # default mode keeps fp32 too
    with bi.batch_invariant(True, without=["fp32_logits"]):
        scaled = bi.sampling_logits(logits, 0.5)
        assert scaled.dtype == torch.bfloat16 and torch.equal(scaled, logits / 0.5)
        assert not torch.equal(logits, scaled)  # divided on a copy
    with bi.batch_invariant(True):
        assert bi.sampling_logits(logits, 0.5).dtype == torch.float32


def test_gdn_recurrent_left_off_takes_the_chunked_kernel_for_prefill(cpu_dispatch):
    from megatron_rl_bi.models.gdn import SwitchedGatedDeltaNet

    with bi.batch_invariant(True):
        assert SwitchedGatedDeltaNet._recurrent(decode_only=False)
    with bi.batch_invariant(True, without=["gdn_recurrent"]):
        assert not SwitchedGatedDeltaNet._recurrent(decode_only=False)
        assert SwitchedGatedDeltaNet._recurrent(decode_only=True)  # a decode-only step stays recurrent


def test_the_trainers_flash_attention_pieces(cpu_dispatch, monkeypatch):
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_rl_bi.attention import flash

    calls = []
    monkeypatch.setattr(flash, "flash_varlen_function",
                        lambda version: lambda q, k, v, **kwargs: calls.append((version, kwargs)) or q)
    config = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4, flash_attention_version=4,
                               attention_dropout=0.0)
    q = torch.randn(3, 4, 16)
    cu = torch.tensor([0, 3], dtype=torch.int32)

    def attend(**pieces):
        with bi.batch_invariant(**pieces):
            flash.FlashCoreAttention(config, 1, None, "self")._varlen(q, q, q, cu, cu, 3, 3)
        version, kwargs = calls.pop()
        return version, kwargs.get("num_splits"), kwargs.get("deterministic")

    assert attend(on=True) == (4, 1, True)
    assert attend(on=True, without=["attention_split"]) == (4, None, True)
    assert attend(on=True, without=["flash_version"]) == (3, 1, True)
    assert attend(on=False) == (4, None, None)


# Every TE entry point megatron-core 0.19.2 patches (module, attribute), by the piece that owns it
TE_ENTRY_POINTS = {
    "gemm": [("transformer_engine.pytorch.cpp_extensions", "general_gemm"),
             ("transformer_engine.pytorch.module.linear", "general_gemm"),
             ("transformer_engine.pytorch.module.layernorm_linear", "general_gemm"),
             ("megatron.core.extensions.transformer_engine", "general_gemm")],
    "te_norm": [("transformer_engine.pytorch.RMSNorm", "forward"),
                ("transformer_engine.pytorch.module.layernorm", "rmsnorm"),
                ("transformer_engine.pytorch.module._common", "apply_normalization"),
                ("transformer_engine.pytorch.module.layernorm_linear", "apply_normalization"),
                ("transformer_engine.pytorch.module.layernorm_mlp", "apply_normalization")],
}


@pytest.fixture
def fake_te(monkeypatch, mm_calls):
    """TransformerEngine's modules as stand-ins, each entry point a function of its own, for
    megatron-core's real TE patch to patch: {(name, attribute): (owner, TE's function)}."""
    import importlib.machinery
    import sys
    import types

    owners = {}
    for name in ["transformer_engine", "transformer_engine.pytorch", "transformer_engine.pytorch.module",
                 *{owner for entries in TE_ENTRY_POINTS.values() for owner, _ in entries if "RMSNorm" not in owner}]:
        owners[name] = types.ModuleType(name)
        owners[name].__spec__ = importlib.machinery.ModuleSpec(name, None)  # megatron-core asks find_spec
        monkeypatch.setitem(sys.modules, name, owners[name])
        parent, _, child = name.rpartition(".")
        if parent:  # `import a.b as c` reads the attribute of the parent first
            monkeypatch.setattr(owners.get(parent) or sys.modules[parent], child, owners[name], raising=False)
    owners["transformer_engine.pytorch.RMSNorm"] = owners["transformer_engine.pytorch"].RMSNorm = type("RMSNorm", (), {})
    entries = {}
    for name, attribute in (entry for piece in TE_ENTRY_POINTS.values() for entry in piece):
        entries[name, attribute] = owners[name], lambda *args, **kwargs: "TE's own"
        setattr(owners[name], attribute, entries[name, attribute][1])
    monkeypatch.setattr(compat, "transformer_engine_installed", lambda: True)
    return entries


def test_te_pieces_left_off_give_te_its_own_kernels_back(fake_te):
    def te_own(piece):
        """Which of the piece's entry points hold TE's own function."""
        return [getattr(fake_te[name, attribute][0], attribute) is fake_te[name, attribute][1]
                for name, attribute in TE_ENTRY_POINTS[piece]]

    with bi.batch_invariant(True):
        assert te_own("gemm") == [False] * 4 and te_own("te_norm") == [False] * 5  # megatron-core patched all
    with bi.batch_invariant(True, without=["te_norm"]):
        assert te_own("gemm") == [False] * 4 and te_own("te_norm") == [True] * 5
    with bi.batch_invariant(True, without=["gemm"]):
        assert te_own("gemm") == [True] * 4 and te_own("te_norm") == [False] * 5
    assert te_own("gemm") == [True] * 4 and te_own("te_norm") == [True] * 5
