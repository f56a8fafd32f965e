"""Compile ahead on the GPU: after the pass (models/compile_ahead.py) and its workers, training
forwards and backwards of other batches compile nothing themselves, Triton's kernels, their
launchers nor FlashAttention-4's: it loads them all from the disk caches the workers wrote; and
the engine's generations (a prefill of a long prompt with short ones, of short ones alone, their
decode steps) compile no FlashAttention-4 kernel, nor a Triton one (its KV appends and GDN state
stores were sent too). A process of its own with empty caches (a test
process has compiled kernels in memory already)."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from tests import REPO

pytestmark = pytest.mark.gpu

SCRIPT = textwrap.dedent("""
    import json, os, pathlib, sys
    import torch
    from triton import knobs
    from triton.backends.nvidia import driver as nvidia_driver
    from megatron_rl_bi.compiling.workers import CompileWorkers
    from megatron_rl_bi.config import parse_args
    from megatron_rl_bi.distributed import initialize_distributed
    from megatron_rl_bi.inference import EngineConfig, Generator, Sampling
    from megatron_rl_bi.models.compile_ahead import compile_ahead
    from megatron_rl_bi.models.logprobs import forward_logprobs
    from megatron_rl_bi.optimizer import build_ddp_and_optimizer
    from megatron_rl_bi.packing import pack_sequences
    from megatron_rl_bi.reporting.compiles import count_triton_compiles
    from tests.gpu.conftest import TINY_HYBRID_ARGS, VOCAB_SIZE, build

    fa4_cache = pathlib.Path(sys.argv[1])
    launchers = lambda: sorted(str(p) for p in pathlib.Path(os.environ["TRITON_CACHE_DIR"]).rglob("__triton_launcher*"))
    compiled = []  # the kernels compiled in this process, by name (the tally calls this after itself)
    def listen(*, metadata, cache_hit, **_):
        if not cache_hit:
            compiled.append(metadata["name"])
    knobs.compilation.listener = listen
    tally = count_triton_compiles()
    initialize_distributed(seed=1234)
    model = build(TINY_HYBRID_ARGS, batch_invariant=True)
    ddp, _ = build_ddp_and_optimizer(parse_args(TINY_HYBRID_ARGS + ["--batch-invariant-mode", "--lr", "1e-5"]), model)
    engine = EngineConfig(max_requests=8, max_tokens=2048, max_sequence_length=1024, buffer_size_gb=0.5)
    workers = CompileWorkers(4)
    outcome = compile_ahead(ddp, workers, VOCAB_SIZE, 1024, (engine.block_size_tokens, engine.max_sequence_length))
    workers.close()
    in_pass = tally.take()
    fa4_before, launchers_before = sorted(str(p) for p in fa4_cache.rglob("*.o")), launchers()
    torch.manual_seed(5)
    # a step's batch of a few long sequences, and an SFT warm-up's of 64 short ones
    for lengths in ((517, 90, 33, 7), [20 + i % 7 for i in range(64)]):
        batch = pack_sequences([torch.randint(0, VOCAB_SIZE, (n,)).tolist() for n in lengths])
        logprobs, _ = forward_logprobs(ddp, batch.to(torch.cuda.current_device()))
        logprobs.sum().backward()
    torch.cuda.synchronize()
    step, fa4_after_step = tally.take(), sorted(str(p) for p in fa4_cache.rglob("*.o"))
    compiled_before_generation = len(compiled)
    launchers_after_step = launchers()
    generator = Generator(model, engine)
    for prompts in ([[5] * 600, [7] * 5, [9] * 40], [[11] * 5, [13] * 12]):
        generator.generate(prompts, Sampling(max_new_tokens=4, seed=3))
    print(json.dumps({"outcome": outcome, "in_pass": in_pass, "step": step, "fa4_before": fa4_before,
                      "fa4_after": fa4_after_step, "generation": tally.take(),
                      "generation_compiled": compiled[compiled_before_generation:],
                      "launchers_built_from_c": hasattr(nvidia_driver, "make_launcher"),
                      "launchers_before": launchers_before, "launchers_after": launchers_after_step,
                      "fa4_after_generation": sorted(str(p) for p in fa4_cache.rglob("*.o"))}))
""")


def test_after_the_pass_training_compiles_nothing_itself(tmp_path):
    fa4_cache = tmp_path / "fa4"
    environment = {**os.environ, "TRITON_CACHE_DIR": str(tmp_path / "triton"),
                   "FLASH_ATTENTION_CUTE_DSL_CACHE_DIR": str(fa4_cache),
                   "FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED": "1",
                   "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    done = subprocess.run([sys.executable, str(script), str(fa4_cache)], env=environment, cwd=REPO,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    outcome = result["outcome"]
    assert outcome["failed"] == [] and outcome["jobs"] > 10, outcome
    assert result["in_pass"]["time/triton_compiles"] == 0  # the pass compiled nothing itself
    assert result["step"]["time/triton_compiles"] == 0, result["step"]
    assert result["step"]["time/triton_cache_loads"] > 10
    assert result["fa4_before"] and result["fa4_after"] == result["fa4_before"]  # FA4 compiled nothing new
    assert result["fa4_after_generation"] == result["fa4_before"]  # nor for the engine
    assert result["generation_compiled"] == [], result["generation"]  # nor the engine's Triton kernels
    # Where Triton builds its launchers from C (3.6), the workers built them, and training none.
    assert bool(result["launchers_before"]) == result["launchers_built_from_c"]
    assert result["launchers_after"] == result["launchers_before"]
    print(json.dumps({"outcome": outcome, "step": result["step"], "generation": result["generation"],
                      "generation_compiled": result["generation_compiled"]}), file=sys.stderr)

