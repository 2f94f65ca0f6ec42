"""Instruction mix of the skinny kernels' one-row paths, compiled for sm_90 without a GPU.

    python benchmarks/gpu/sass_op_counts.py     # no TRITON_INTERPRET; needs Triton's nvdisasm

Compiles ``int4_gemv`` and ``fp8_gemv`` for the H100 with the specialisation a real launch
gets (``tests/kernels/sm90_compile_check.py``), disassembles the cubin with Triton's bundled
``nvdisasm`` and prints the most frequent SASS opcodes of the whole kernel (the K loop is most
of it) and the SASS instructions per weight of one loop step. An H100 SM issues about 128
thread-instructions per clock and its share of the memory bandwidth is ~13 bytes per clock,
so a one-row kernel stays memory-bound only below ~10 instructions per byte of weight (fp8:
~10 per weight; int4: ~5 per weight, two weights per byte). One JSON line per kernel.
"""

from __future__ import annotations

import collections
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import triton
from triton.compiler import ASTSource

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "kernels"))
import sm90_compile_check as check  # noqa: E402

from octavo.kernels.triton.fp8_gemv import _fp8_gemv_kernel  # noqa: E402
from octavo.kernels.triton.int4_gemv import _int4_gemv_kernel  # noqa: E402

NVDISASM = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"


def sass_ops(fn, signature: dict, constexprs: dict, num_warps: int) -> collections.Counter:
    attrs = {(fn.arg_names.index(name),): [["tt.divisibility", 16]]
             for name in check.ALIGNED if name in signature}
    kernel = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs,
                                      attrs=attrs),
                            target=check.TARGET, options={"num_warps": num_warps,
                                                          "num_stages": 2})
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(kernel.asm["cubin"])
        cubin.flush()
        sass = subprocess.run([str(NVDISASM), "-c", cubin.name], capture_output=True,
                              text=True, check=True).stdout
    pattern = r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)"
    return collections.Counter(re.findall(pattern, sass, re.M))


def main() -> None:
    cases = [
        ("int4_gemv", _int4_gemv_kernel, {**check.INT4_SIG, "out_ptr": "*fp32"},
         {"HAS_G_IDX": False, "BLOCK_M": 1, "BLOCK_N": 128, "BLOCK_K": 128, "SPLIT_K": 2,
          "UPCAST_DOT": False}, 128 * 128),
        ("fp8_gemv", _fp8_gemv_kernel, check.FP8_SIG,
         {"BLOCK_M": 1, "BLOCK_N": 16, "BLOCK_K": 512, "SPLIT_K": 1, "UPCAST_DOT": False},
         16 * 512),
    ]
    for name, fn, signature, consts, weights_per_step in cases:
        ops = sass_ops(fn, signature, consts, 4)
        total = sum(ops.values())
        per_weight = total / (weights_per_step / 128)  # 128 threads share a step's weights
        print(f"{name}: {total} SASS instructions per thread, one K step = "
              f"{weights_per_step // 128} weights per thread -> ~{per_weight:.1f} per weight")
        print("   ", ", ".join(f"{op} {n}" for op, n in ops.most_common(12)))
        print(json.dumps({"kernel": name, **consts, "sass_total": total,
                          "sass_per_weight": round(per_weight, 2), "ops": dict(ops)}))


if __name__ == "__main__":
    main()
