"""One compile worker (compiling/workers.py starts it): reads JSON jobs from its input, a line
each, compiles each into the disk cache the run reads, and answers each with a line:
{"name", "seconds"}, and "error" when it failed.

Jobs (models/compile_ahead.py writes them):
- "triton": a launch's serialized specialization (what Triton's `jit_cache_hook` is given) and
  the run's GPU target; compiled as the launch would have been, for that target, without a GPU,
  and its launcher built (the driver's launcher class: the node's GPU driver, no device used).
- "flash_attention": a FlashAttention-4 varlen call's tensors (shape, strides, dtype), integer
  tensors' values and keywords; made on this process's GPU and called, so FlashAttention-4
  compiles its kernels into its disk cache (on in the package): the forward's ("part":
  "forward"), or the backward's alone ("backward"), which another worker compiles meanwhile.
"""

import sys

from megatron_rl_bi.compiling.workers import END, end_with_the_run

if __name__ == "__main__":  # first: the imports below take seconds, and the run may end meanwhile
    end_with_the_run(int(sys.argv[1]))

import functools
import importlib
import importlib.util
import json
import os
import time

import torch
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.runtime import driver
from triton.runtime.jit import JITFunction, convert_to_tuple_if_list

# What holds the kernels the jobs name (the package's model code imports its BI kernels, fla's and
# megatron-core's) and FlashAttention-4: seconds of imports, made before the first job, while the
# run makes its own.
KERNEL_MODULES = ("megatron_rl_bi.models.build", "flash_attn.cute")


def import_kernel_modules() -> None:
    for name in KERNEL_MODULES:
        if importlib.util.find_spec(name.split(".")[0]) is not None:
            try:
                importlib.import_module(name)
            except ImportError:
                pass  # flash_attn that is not FlashAttention-4: no job needs it


def _named(full_name: str):
    """The object `module.qualname` (or `module:qualname`) names."""
    if ":" in full_name:
        module_name, qualname = full_name.split(":", 1)
        return functools.reduce(getattr, qualname.split("."), importlib.import_module(module_name))
    parts = full_name.split(".")
    for split in range(len(parts) - 1, 0, -1):
        try:
            module = importlib.import_module(".".join(parts[:split]))
        except ModuleNotFoundError:
            continue
        return functools.reduce(getattr, parts[split:], module)
    raise ModuleNotFoundError(f"no module holds {full_name}")


def jit_function(full_name: str) -> JITFunction:
    """The Triton kernel `module.qualname`, unwrapped from its autotuner and heuristics."""
    obj = _named(full_name)
    while not isinstance(obj, JITFunction):
        obj = obj.fn
    return obj


def _constexpr(value):
    """A constant as Triton's specialization data serializes it, back (JITFunction.preload's
    rules, and a kernel passed as a constant)."""
    if isinstance(value, dict) and "constexpr" in value:
        return tl.constexpr(value["constexpr"])
    if isinstance(value, dict) and "jit_function" in value:
        return _named(value["jit_function"])
    return tl.dtype(value) if tl.dtype.is_dtype(value) else value


def compile_triton(job: dict) -> None:
    """Compile one launch's specialization for the run's target, as Triton's launch would
    (JITFunction._do_compile), into this process's Triton cache: the run's."""
    spec = json.loads(job["specialization"])
    fn = jit_function(spec["name"])
    target = GPUTarget(*job["target"])
    constexprs = {tuple(key): _constexpr(value) for key, value in zip(spec["constant_keys"], spec["constant_vals"])}
    attrs = dict(zip(map(tuple, spec["attrs_keys"]), spec["attrs_vals"]))
    signature = {key: convert_to_tuple_if_list(value) for key, value in spec["signature"].items()}
    options = {key: tuple(value) if isinstance(value, list) else value for key, value in spec["options"].items()}
    options = triton.compiler.make_backend(target).parse_options(options)
    kernel = triton.compile(triton.compiler.ASTSource(fn, signature, constexprs, attrs), target=target,
                            options=options.__dict__)
    # Triton 3.6 builds each kernel's launcher from C with the host's C compiler at its first launch
    # (0.3 s each: 26 of them made 7.4 s of a fresh tiny hybrid run's SFT warm-up and first step);
    # built here, it lands in the same cache, where that launch finds it.
    driver.active.launcher_cls(kernel.src, kernel.metadata)


def _tensor(description: dict, requires_grad: bool) -> torch.Tensor:
    """A tensor on this process's GPU with the shape, strides and dtype described, random values
    (or the integers given)."""
    dtype = getattr(torch, description["dtype"])
    if "values" in description:
        return torch.tensor(description["values"], dtype=dtype, device="cuda")
    tensor = torch.empty_strided(description["shape"], description["stride"], dtype=dtype, device="cuda")
    return tensor.normal_().requires_grad_(requires_grad)


def _forward_skipped(q, k, v, *, cu_seqlens_q=None, **_):
    """Stands in for FlashAttention-4's forward kernel call (`interface._flash_attn_fwd` of
    4.0.0b36, which returns out, lse, p, row_max, o_lo) in a backward job: an output and a
    log-sum-exp of the shapes it gives (lse [heads, tokens] for packed sequences), random, so the
    backward's kernels compile and the forward's do not."""
    out = torch.randn(*q.shape[:-1], v.shape[-1], dtype=q.dtype, device=q.device)
    lse_shape = (q.shape[1], q.shape[0]) if cu_seqlens_q is not None else (q.shape[0], q.shape[2], q.shape[1])
    return out, torch.randn(lse_shape, dtype=torch.float32, device=q.device), None, None, None


def compile_flash_attention(job: dict) -> None:
    """Call FlashAttention-4's varlen function as the run did, with its tensors' gradients (they
    choose the forward's kernel): the forward part, or the backward part with the forward's kernel
    call skipped. Each compiles the kernels it lacks and keeps them in its disk cache."""
    from flash_attn.cute import flash_attn_varlen_func, interface

    q, k, v = (_tensor(job["tensors"][name], job["grad"]) for name in ("q", "k", "v"))
    kwargs = {name: _tensor(value, False) if isinstance(value, dict) else value
              for name, value in job["kwargs"].items()}
    if job["part"] == "forward":
        flash_attn_varlen_func(q, k, v, **kwargs)
    else:
        forward_kernel, interface._flash_attn_fwd = interface._flash_attn_fwd, _forward_skipped
        try:
            out = flash_attn_varlen_func(q, k, v, **kwargs)[0]
        finally:
            interface._flash_attn_fwd = forward_kernel
        out.backward(torch.ones_like(out))
    torch.cuda.synchronize()


COMPILERS = {"triton": compile_triton, "flash_attention": compile_flash_attention}


def main() -> None:
    answers = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # what the compilers print goes to stderr: stdout carries the answers only
    import_kernel_modules()
    for line in sys.stdin:
        job = json.loads(line)
        if job["kind"] == END:
            break
        started = time.perf_counter()
        answer = {"name": job["name"]}
        try:
            COMPILERS[job["kind"]](job)
        except Exception as exc:  # the run compiles this one itself: report why, go on
            answer["error"] = f"{job['name']}: {type(exc).__name__}: {exc}"
        answer["seconds"] = time.perf_counter() - started
        answers.write(json.dumps(answer) + "\n")


if __name__ == "__main__":
    main()
