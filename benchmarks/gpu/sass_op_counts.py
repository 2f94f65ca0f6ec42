"""Instruction mix of the skinny kernels' one-row paths, compiled for sm_90 without a GPU.

    env -u TRITON_INTERPRET TRITON_DEFAULT_FP_FUSION=1 python benchmarks/gpu/sass_op_counts.py

Compiles ``int4_gemv`` and ``fp8_gemv`` for the H100 with the specialisation a real launch
gets (``tests/kernels/sm90_compile_check.py``; the int4 kernel's compile-time arguments from
``int4_gemv.kernel_constexprs``), disassembles the cubin with Triton's bundled ``nvdisasm``
and prints, per launch config, the SASS instructions of one K-loop step (the loop body)
and of the whole kernel, the instructions per weight of a step, and the loop's most frequent
opcodes. An H100 SM issues about 128 thread-instructions per clock and its share of the
memory bandwidth is ~13 bytes per clock, so a one-row kernel stays memory-bound only below
~10 instructions per byte of weight (fp8: ~10 per weight; int4: ~5 per weight, two weights
per byte). One JSON line per kernel and config.
"""

from __future__ import annotations

import collections
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "kernels"))
import sm90_compile_check as check
from octavo.kernels.triton import int4_gemv
from octavo.kernels.triton.fp8_gemv import _fp8_gemv_kernel
from octavo.kernels.triton.int4_gemv import _int4_gemv_kernel
from octavo.kernels.triton.skinny_gemm import SkinnyConfig


def count(name: str, fn, signature: dict, consts: dict, config: SkinnyConfig) -> None:
    code = check.sass(check.compile_kernel(fn, signature, consts, config.num_warps,
                                           config.num_stages))
    loop = collections.Counter(check.sass_opcodes(check.sass_loop(code)))
    total = len(check.sass_opcodes(code))
    step = sum(loop.values())
    weights = consts["BLOCK_N"] * consts["BLOCK_K"] // (32 * config.num_warps)  # per thread
    staged = f" ls{config.load_stages}" if config.load_stages > 1 else ""
    print(f"{name} n{consts['BLOCK_N']} k{consts['BLOCK_K']} w{config.num_warps}{staged}: K step "
          f"{step} SASS per thread for {weights} weights -> {step / weights:.2f} per weight "
          f"(whole kernel {total})")
    print("   ", ", ".join(f"{op} {n}" for op, n in loop.most_common(12)))
    print(json.dumps({"kernel": name, **consts, "num_warps": config.num_warps,
                      "loop_sass": step, "kernel_sass": total,
                      "loop_sass_per_weight": round(step / weights, 2), "loop_ops": dict(loop)}))


def main() -> None:
    # The one-row default and the tuner's candidates (block_k as cut for groups of 128).
    # (split-K changes only the epilogue: each loop shape once)
    loops = {(c.block_n, c.block_k, c.num_warps, c.load_stages): c
             for c in [int4_gemv.default_config(4096, 4096, 1),
                       *int4_gemv.candidate_configs(1)]}
    for config in loops.values():
        count("int4_gemv", _int4_gemv_kernel, check.INT4_SIG,
              check.int4_constexprs(1, config), config)
    count("fp8_gemv", _fp8_gemv_kernel, check.FP8_SIG,
          {"BLOCK_M": 1, "BLOCK_N": 16, "BLOCK_K": 512, "SPLIT_K": 1, "IN_KERNEL_SUM": False,
           "UPCAST_DOT": False, "EARLY_TRIGGER": True, "EVEN_K": True, "EVEN_N": True,
           "SUM_RUN": 0, "LOAD_STAGES": 0, "USE_PDL": False},
          SkinnyConfig(16, 512))


if __name__ == "__main__":
    main()
