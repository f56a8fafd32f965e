"""The GDN rule's chunked backward on the GPU with the 'auto' backend (what layers train with):
fla's chunked backward, whose gated `chunk_bwd_dqkwg` step runs as this package's Triton kernel
where fla 0.6.0 refuses it (Hopper with Triton >= 3.4 and < 3.7.1: models/gdn_dqkwg_triton.py).
Against the fp32 torch rule on packed sequences with initial states: forward bits unchanged,
gradients within the loosest ratio fla's own tests allow bf16 kernels against fp32 references
(0.02, relative L2). The kernel alone against its torch reference (models/gdn_dqkwg.py) on the
arguments a real backward gives it: within the bf16 rounding of its outputs (0.005, relative L2:
the two take the same fp32 products of the same bf16 operands, summed in another order, and round
dq, dk and dw to bf16 once, a relative error of at most 2**-9 each)."""

import pytest
import torch
import torch.nn.functional as F

from megatron_rl_bi import compat
from megatron_rl_bi.models.gdn_rule import gated_delta_rule
from megatron_rl_bi.numerics import relative_l2_error

pytestmark = pytest.mark.gpu

FLA_TEST_RATIO = 0.02
KERNEL_VS_TORCH_STEP = 0.005


def _packed(lengths, heads, key_dim, value_dim, seed):
    """q, k, v, g, beta in the dtypes megatron-core's layer gives them, fp32 initial states."""
    generator = torch.Generator(device="cuda").manual_seed(seed)
    tokens = sum(lengths)

    def rand(*shape):
        return torch.randn(*shape, device="cuda", generator=generator)

    q, k = (F.normalize(rand(1, tokens, heads, key_dim), dim=-1).bfloat16() for _ in range(2))
    v = rand(1, tokens, heads, value_dim).bfloat16()
    g = -0.1 * rand(1, tokens, heads).abs()
    beta = torch.sigmoid(rand(1, tokens, heads)).bfloat16()
    state = 0.1 * rand(len(lengths), heads, key_dim, value_dim)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device="cuda", dtype=torch.int32)
    return [t.requires_grad_(True) for t in (q, k, v, g, beta, state)], cu


def _forward_and_gradients(forward, heads, key_dim):
    """Output, final states and input gradients of the rule with the torch rule's backward and
    with the 'auto' one."""
    results = {}
    for backend in ("torch", "auto"):
        inputs, cu = _packed((4096, 1000, 3096), heads, key_dim, 128, seed=2)
        q, k, v, g, beta, state = inputs
        out, final = gated_delta_rule(q, k, v, g, beta, initial_state=state, output_final_state=True,
                                      cu_seqlens=cu, forward=forward, chunk_backend=backend)
        torch.autograd.backward([out, final], [torch.ones_like(out), torch.ones_like(final)])
        results[backend] = (out.detach(), final.detach(), [t.grad for t in inputs])
    return results


def _check_auto_against_the_torch_rule(results):
    assert torch.equal(results["auto"][0], results["torch"][0]) and torch.equal(results["auto"][1], results["torch"][1])
    for name, got, reference in zip("q k v g beta state".split(), results["auto"][2], results["torch"][2]):
        assert relative_l2_error(got, reference) <= FLA_TEST_RATIO, name


@pytest.mark.parametrize("forward", ["recurrent", "chunk"])  # BI mode's forward kernel, default mode's
@pytest.mark.parametrize("heads, key_dim", [(32, 128), (16, 64)])
def test_auto_backward_keeps_the_forward_bits_and_the_torch_rules_gradients(forward, heads, key_dim):
    _check_auto_against_the_torch_rule(_forward_and_gradients(forward, heads, key_dim))


def _recorded_dqkwg_call(monkeypatch, lengths, heads, key_dim):
    """The arguments fla's chunked backward gives its gated `chunk_bwd_dqkwg`, from one backward."""
    import fla.ops.gated_delta_rule.chunk as gated_delta_rule_chunk

    from megatron_rl_bi.models import gdn_rule

    gdn_rule._fla_chunk_backward_here()  # installs the kernel first where fla refuses its own
    calls, installed = [], gated_delta_rule_chunk.chunk_bwd_dqkwg

    def record(*args, **kwargs):
        calls.append((args, kwargs))
        return installed(*args, **kwargs)

    monkeypatch.setattr(gated_delta_rule_chunk, "chunk_bwd_dqkwg", record)
    inputs, cu = _packed(lengths, heads, key_dim, 128, seed=4)
    out, _ = gated_delta_rule(*inputs[:5], initial_state=inputs[5], cu_seqlens=cu, chunk_backend="auto")
    out.float().sum().backward()
    return calls[0]


@pytest.mark.parametrize("heads, key_dim", [(32, 128), (16, 64)])
def test_the_dqkwg_kernel_gives_its_torch_references_gradients(monkeypatch, heads, key_dim):
    from megatron_rl_bi.models.gdn_dqkwg import chunk_bwd_dqkwg as reference
    from megatron_rl_bi.models.gdn_dqkwg_triton import chunk_bwd_dqkwg as kernel

    args, kwargs = _recorded_dqkwg_call(monkeypatch, (4096, 1000, 3096), heads, key_dim)
    for name, got, want in zip(("dq", "dk", "dw", "dg"), kernel(*args, **kwargs), reference(*args, **kwargs)):
        assert got.shape == want.shape and got.dtype == want.dtype, name
        assert relative_l2_error(got, want) <= KERNEL_VS_TORCH_STEP, name


@pytest.mark.skipif(compat.fla_chunk_backward_works(),
                    reason="fla runs its chunked backward itself here (not Hopper, or Triton >= 3.7.1)")
def test_where_fla_refuses_its_backward_the_kernel_stands_in():
    import fla.ops.gated_delta_rule.chunk as gated_delta_rule_chunk

    from megatron_rl_bi.models.gdn_dqkwg_triton import chunk_bwd_dqkwg

    inputs, cu = _packed((300,), 4, 128, 128, seed=3)
    out, _ = gated_delta_rule(*inputs[:5], initial_state=inputs[5], cu_seqlens=cu, chunk_backend="auto")
    out.sum().backward()
    assert gated_delta_rule_chunk.chunk_bwd_dqkwg is chunk_bwd_dqkwg


def _fla_autotuners() -> list:
    """Every Triton autotuner of fla's imported modules (under a heuristics wrapper or not)."""
    import sys

    from triton.runtime.autotuner import Autotuner

    found = {}
    for name, module in list(sys.modules.items()):
        if not name.startswith("fla.") or module is None:
            continue
        for value in vars(module).values():
            while value is not None and not isinstance(value, Autotuner) and hasattr(value, "fn"):
                value = value.fn
            if isinstance(value, Autotuner):
                found[id(value)] = value
    return list(found.values())


def _bi_backward_under_timings(monkeypatch, fastest_first: bool):
    """The 'auto' backward's input gradients after every fla autotuner forgot its picks, kept its
    first and last candidates and had its benchmark rank them first-fastest or last-fastest; and
    the picks."""
    tuners = _fla_autotuners()
    assert tuners, "no fla autotuner found"
    for tuner in tuners:
        tuner.cache.clear()
        tuner.__dict__.pop("_untimed_picks", None)
        monkeypatch.setattr(tuner, "cache_results", False)
        # the first and the last candidate alone: the test compiles two a kernel, not dozens
        monkeypatch.setattr(tuner, "configs", [tuner.configs[0], tuner.configs[-1]])
        ranks = {id(config): i for i, config in enumerate(tuner.configs)}

        def ranked(kernel_call, quantiles, tuner=tuner, ranks=ranks):
            kernel_call()
            rank = ranks[id(tuner._benched)] if hasattr(tuner, "_benched") else 0
            return [float(rank if fastest_first else -rank)] * len(quantiles)
        monkeypatch.setitem(tuner.__dict__, "do_bench", ranked)
    inputs, cu = _packed((4096, 1000, 3096), 4, 64, 64, seed=3)
    q, k, v, g, beta, state = inputs
    out, final = gated_delta_rule(q, k, v, g, beta, initial_state=state, output_final_state=True,
                                  cu_seqlens=cu, forward="recurrent", chunk_backend="auto")
    torch.autograd.backward([out, final], [torch.ones_like(out), torch.ones_like(final)])
    return [t.grad for t in inputs], {id(t): dict(t.cache) for t in tuners}


def test_bi_backward_bits_do_not_depend_on_the_autotuners_timings(monkeypatch):
    """fla's chunked kernels pick block sizes by timing (bi/autotune.py): in default mode two
    rankings of the same candidates pick otherwise and give other gradient bits; with the switch
    on, every gradient bit is the same whatever the timings say."""
    from triton.runtime.autotuner import Autotuner

    from megatron_rl_bi import bi

    # the candidate being benched, for the ranking above (Triton passes only a closure to it)
    timed_bench = Autotuner._bench

    def bench(self, *args, config, **meta):
        self._benched = config
        return timed_bench(self, *args, config=config, **meta)
    monkeypatch.setattr(Autotuner, "_bench", bench)
    default_grads_first, default_first = _bi_backward_under_timings(monkeypatch, fastest_first=True)
    default_grads_last, default_last = _bi_backward_under_timings(monkeypatch, fastest_first=False)
    assert default_first != default_last, "the rankings did not change any pick: the test shows nothing"
    with bi.batch_invariant():
        grads_first, _ = _bi_backward_under_timings(monkeypatch, fastest_first=True)
        grads_last, _ = _bi_backward_under_timings(monkeypatch, fastest_first=False)
    for name, first, last in zip("q k v g beta state".split(), grads_first, grads_last):
        assert torch.equal(first, last), name
    moved = [name for name, first, last in zip("q k v g beta state".split(), default_grads_first, default_grads_last)
             if not torch.equal(first, last)]
    assert moved, "in default mode the other picks moved no gradient bit: timings would not explain moved bits"
