"""Compiles the BI GEMMs' kernels for an H100/H200 (sm_90a) with the installed Triton and ptxas, no
GPU needed, and prints as JSON each kernel variant's ptxas spill bytes, whether its machine code is its
fully specialized compile's, and the launch keys of the BI GEMM, the RMSNorm backward and the GDN
backward's dq/dk/dw/dg step. Run as a process of its own
(`python -m tests.sm90_spills`): the CPU tests run Triton's interpreter, whose kernels do not compile.
Used by tests/unit_tests/test_bi_gemm_compiles.py."""

import json
import os
import re
import subprocess
import sys
import tempfile

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from megatron_rl_bi.bi import gemm, grouped_gemm, rmsnorm
from megatron_rl_bi.models import gdn_dqkwg_triton as dqkwg

PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
NVDISASM = os.path.join(os.path.dirname(PTXAS), "nvdisasm")


def compiling_environment(**more: str) -> dict[str, str]:
    """This process's environment for one that compiles Triton kernels: without TRITON_INTERPRET,
    which the CPU tests set and under which nothing compiles; with `more` added."""
    return {**{key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}, **more}


def compile_sm90(fn, signature: dict, constexprs: dict, num_warps: int, num_stages: int,
                 divisible: tuple[str, ...] | None = None) -> str:
    """`fn` compiled for sm_90a, its PTX. Every pointer is a multiple of 16, and the integer
    arguments named in `divisible`; by default those `fn` specializes, as a launch on real widths."""
    if divisible is None:
        divisible = tuple(param.name for param in fn.params if not param.do_not_specialize)
    signature = {**signature, **{name: "constexpr" for name in constexprs}}
    names = list(signature)
    attrs = {(i,): [["tt.divisibility", 16]] for i, (name, kind) in enumerate(signature.items())
             if kind.startswith("*") or (kind != "constexpr" and name in divisible)}
    source = ASTSource(fn=fn, signature=signature, attrs=attrs,
                       constexprs={(names.index(name),): value for name, value in constexprs.items()})
    kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": num_warps, "num_stages": num_stages})
    return kernel.asm["ptx"]


def ptxas(ptx: str, *flags: str) -> tuple[str, bytes]:
    """ptxas's report and the cubin of `ptx` for sm_90a."""
    with tempfile.TemporaryDirectory() as scratch:
        source, cubin = os.path.join(scratch, "k.ptx"), os.path.join(scratch, "k.cubin")
        with open(source, "w") as f:
            f.write(ptx)
        report = subprocess.run([PTXAS, "--gpu-name", "sm_90a", *flags, source, "-o", cubin],
                                capture_output=True, text=True, check=True).stderr
        with open(cubin, "rb") as f:
            return report, f.read()


def spill_bytes(report: str) -> int:
    """The spill stores and loads, in bytes, of ptxas's verbose report."""
    return sum(int(n) for n in re.findall(r"(\d+) bytes spill (?:stores|loads)", report))


def machine_code(cubin: bytes) -> list[str]:
    """The SASS instructions of `cubin`, without their addresses."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        listing = subprocess.run([NVDISASM, "-c", f.name], capture_output=True, text=True, check=True).stdout
    return [re.sub(r"/\*[0-9a-f]+\*/", "", line).strip() for line in listing.splitlines()
            if re.match(r"\s+/\*[0-9a-f]{4,}\*/", line)]


def specialization_report(fn, signature: dict, constexprs: dict, num_warps: int, num_stages: int) -> dict:
    """`fn` compiled as launched: its spill bytes, and whether its machine code is that of its
    compile with every integer argument a multiple of 16."""
    integers = tuple(name for name, kind in signature.items() if kind.startswith("i"))
    report, launched = ptxas(compile_sm90(fn, signature, constexprs, num_warps, num_stages), "-v")
    _, specialized = ptxas(compile_sm90(fn, signature, constexprs, num_warps, num_stages, integers))
    return {"spills": spill_bytes(report), "as_specialized": machine_code(launched) == machine_code(specialized)}


def matmul_report(config: gemm.TileConfig, a_column_major: bool, b_column_major: bool) -> dict:
    signature = {**{name: "*bf16" for name in ("a_ptr", "b_ptr", "c_ptr", "bias_ptr")},
                 **{name: "i32" for name in ("M", "N", "K", "a_row_stride", "b_row_stride", "num_programs")}}
    constexprs = dict(BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
                      GROUP_M=gemm.GROUP_M, A_COLUMN_MAJOR=a_column_major, B_COLUMN_MAJOR=b_column_major,
                      HAS_BIAS=True)
    return specialization_report(gemm._persistent_matmul, signature, constexprs, config.num_warps, config.num_stages)


def launch_keys(fn, launches: list[tuple[tuple, dict]]) -> int:
    """How many compiled variants of `fn` Triton's launcher asks for over `launches` (the
    arguments of each): the specialization keys of their launches."""
    from triton.compiler.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    bind = create_function_from_signature(fn.signature, fn.params, make_backend(GPUTarget("cuda", 90, 32)))
    return len({tuple(bind(*args, **kwargs)[1]) for args, kwargs in launches})


def matmul_launch_keys(config: gemm.TileConfig, a_column_major: bool, b_column_major: bool) -> int:
    """Over products of one tile and layout whose M and K range from 1 to 1,000 (as packed batches
    and decode steps give it; N, a layer's width, a multiple of 16)."""
    launches = []
    for m, k, n in [(1, 256, 512), (16, 256, 512), (17, 704, 512), (64, 64, 1024), (100, 1000, 256), (1000, 48, 4096)]:
        a = torch.empty((k, m) if a_column_major else (m, k), dtype=torch.bfloat16)
        b = torch.empty((n, k) if b_column_major else (k, n), dtype=torch.bfloat16)
        tiles = triton.cdiv(m, config.block_m) * triton.cdiv(n, config.block_n)
        launches.append(((a, b, torch.empty(m, n, dtype=torch.bfloat16), None, m, n, k, a.stride(0), b.stride(0),
                          min(132, tiles)),
                         dict(BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
                              GROUP_M=gemm.GROUP_M, A_COLUMN_MAJOR=a_column_major, B_COLUMN_MAJOR=b_column_major,
                              HAS_BIAS=False, num_stages=config.num_stages, num_warps=config.num_warps)))
    return launch_keys(gemm._persistent_matmul, launches)


RMSNORM_BACKWARD = {"dy_ptr": "*bf16", "x_ptr": "*bf16", "w_ptr": "*bf16", "rsigma_ptr": "*fp32", "dx_ptr": "*bf16",
                    "dw_partial_ptr": "*fp32", "rows": "i32", "D": "i32"}


def rmsnorm_backward_report(d: int = 2048) -> dict:
    """The RMSNorm backward at width `d`: whether as launched it has the machine code of its compile
    with every integer a multiple of 16, and its launch keys over 1 to 1,000 rows."""
    options = rmsnorm._launch_options(d)
    constexprs = dict(ZERO_CENTERED=False, ROWS_PER_PROGRAM=rmsnorm.ROWS_PER_PROGRAM, BLOCK=options["BLOCK"])
    report = specialization_report(rmsnorm._backward, RMSNORM_BACKWARD, constexprs, options["num_warps"], 3)
    launches = []
    for rows in (1, 16, 17, 100, 1000):
        x = torch.empty(rows, d, dtype=torch.bfloat16)
        rsigma, partial = torch.empty(rows), torch.empty(triton.cdiv(rows, rmsnorm.ROWS_PER_PROGRAM), d)
        launches.append(((x, x, torch.empty(d, dtype=torch.bfloat16), rsigma, x, partial, rows, d),
                         dict(ZERO_CENTERED=False, ROWS_PER_PROGRAM=rmsnorm.ROWS_PER_PROGRAM, **options)))
    return {"as_specialized": report["as_specialized"], "launch_keys": launch_keys(rmsnorm._backward, launches)}


DQKWG = {**{name: "*bf16" for name in ("q", "k", "v")}, "g": "*fp32", **{name: "*bf16" for name in ("h", "do", "dh", "dv")},
         **{name: "*bf16" for name in ("dq", "dk", "dw")}, "dg": "*fp32", "chunk_start": "*i32", "chunk_end": "*i32",
         "scale": "fp32", "total": "i32"}


def dqkwg_report(heads: int = 16, value_heads: int = 32, key_dim: int = 128, value_dim: int = 128) -> dict:
    """The GDN backward's dq/dk/dw/dg step (models/gdn_dqkwg_triton.py) at Qwen3.5-9B's GDN widths:
    whether as launched it has the machine code of its compile with every integer a multiple of
    16, and its launch keys over packed batches of 1 to 1,000 tokens."""
    constexprs = dict(H=heads, HV=value_heads, K=key_dim, V=value_dim, BT=64, BK=min(key_dim, dqkwg.KEY_BLOCK),
                      BV=min(value_dim, dqkwg.VALUE_BLOCK), STATE_V_FIRST=False)
    report = specialization_report(dqkwg._dqkwg_kernel, DQKWG, constexprs, dqkwg.NUM_WARPS, 3)
    launches = []
    for total in (1, 16, 17, 100, 1000):
        t = {name: torch.empty(8, dtype=torch.float32 if kind == "*fp32" else torch.int32 if kind == "*i32"
                               else torch.bfloat16) for name, kind in DQKWG.items() if kind.startswith("*")}
        launches.append(((*t.values(), 0.1, total), dict(**constexprs, num_warps=dqkwg.NUM_WARPS)))
    return {"as_specialized": report["as_specialized"], "launch_keys": launch_keys(dqkwg._dqkwg_kernel, launches)}


def grouped_spills() -> int:
    signature = {"rows_ptr": "*bf16", "weight_table_ptr": "*i64", "out_ptr": "*bf16", "row_offsets_ptr": "*i64",
                 "tile_offsets_ptr": "*i64", "tile_experts_ptr": "*i64", "num_experts": "i32", "N": "i32",
                 "K": "i32"}
    constexprs = dict(BLOCK_M=grouped_gemm.BLOCK_M, BLOCK_N=grouped_gemm.BLOCK_N, BLOCK_K=grouped_gemm.BLOCK_K)
    return spill_bytes(ptxas(compile_sm90(grouped_gemm._grouped_matmul, signature, constexprs, 4, 3), "-v")[0])


def main() -> None:
    """argv: JSON list of [block_m, block_n, num_stages, num_warps, block_k, a_column_major, b_column_major]."""
    variants = json.loads(sys.argv[1])
    reports = [matmul_report(gemm.TileConfig(*v[:5]), v[5], v[6]) for v in variants]
    spills = {"matmul": [report["spills"] for report in reports],
              "matmul_as_specialized": [report["as_specialized"] for report in reports],
              "matmul_launch_keys": [matmul_launch_keys(gemm.TileConfig(*v[:5]), v[5], v[6]) for v in variants],
              "grouped": grouped_spills(),
              "rmsnorm_backward": rmsnorm_backward_report(),
              "gdn_dqkwg": dqkwg_report()}
    print(json.dumps(spills))


if __name__ == "__main__":
    main()
