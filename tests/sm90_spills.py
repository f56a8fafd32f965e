"""Compiles the BI GEMMs' kernels for an H100/H200 (sm_90a) with the installed Triton and ptxas, no
GPU needed, and prints each kernel variant's ptxas spill bytes as JSON. Run as a process of its own
(`python -m tests.sm90_spills`): the CPU tests run Triton's interpreter, whose kernels do not compile.
Used by tests/unit_tests/test_bi_gemm_compiles.py."""

import json
import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from megatron_rl_bi.bi import gemm, grouped_gemm

PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")


def compiling_environment(**more: str) -> dict[str, str]:
    """This process's environment for one that compiles Triton kernels: without TRITON_INTERPRET,
    which the CPU tests set and under which nothing compiles; with `more` added."""
    return {**{key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}, **more}


def spill_bytes(fn, signature: dict, constexprs: dict, num_warps: int, num_stages: int) -> int:
    """ptxas's spill stores and loads, in bytes, of `fn` compiled for sm_90a, specialized as a launch
    on real widths is: every pointer and integer argument a multiple of 16."""
    signature = {**signature, **{name: "constexpr" for name in constexprs}}
    names = list(signature)
    divisible = {(i,): [["tt.divisibility", 16]] for i, kind in enumerate(signature.values()) if kind != "constexpr"}
    source = ASTSource(fn=fn, signature=signature, attrs=divisible,
                       constexprs={(names.index(name),): value for name, value in constexprs.items()})
    kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": num_warps, "num_stages": num_stages})
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as ptx:
        ptx.write(kernel.asm["ptx"])
        ptx.flush()
        report = subprocess.run([PTXAS, "--gpu-name", "sm_90a", "-v", ptx.name, "-o", os.devnull],
                                capture_output=True, text=True, check=True).stderr
    return sum(int(n) for n in re.findall(r"(\d+) bytes spill (?:stores|loads)", report))


def matmul_spills(config: gemm.TileConfig, a_column_major: bool, b_column_major: bool) -> int:
    pointers = {name: "*bf16" for name in ("a_ptr", "b_ptr", "c_ptr", "bias_ptr")}
    scalars = {name: "i32" for name in ("M", "N", "K", "a_row_stride", "b_row_stride", "num_programs")}
    constexprs = dict(BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
                      GROUP_M=gemm.GROUP_M, A_COLUMN_MAJOR=a_column_major, B_COLUMN_MAJOR=b_column_major,
                      HAS_BIAS=True)
    return spill_bytes(gemm._persistent_matmul, {**pointers, **scalars}, constexprs, config.num_warps,
                       config.num_stages)


def grouped_spills() -> int:
    signature = {"rows_ptr": "*bf16", "weight_table_ptr": "*i64", "out_ptr": "*bf16", "row_offsets_ptr": "*i64",
                 "tile_offsets_ptr": "*i64", "tile_experts_ptr": "*i64", "num_experts": "i32", "N": "i32",
                 "K": "i32"}
    constexprs = dict(BLOCK_M=grouped_gemm.BLOCK_M, BLOCK_N=grouped_gemm.BLOCK_N, BLOCK_K=grouped_gemm.BLOCK_K)
    return spill_bytes(grouped_gemm._grouped_matmul, signature, constexprs, 4, 3)


def main() -> None:
    """argv: JSON list of [block_m, block_n, num_stages, num_warps, block_k, a_column_major, b_column_major]."""
    variants = json.loads(sys.argv[1])
    spills = {"matmul": [matmul_spills(gemm.TileConfig(*v[:5]), v[5], v[6]) for v in variants],
              "grouped": grouped_spills()}
    print(json.dumps(spills))


if __name__ == "__main__":
    main()
