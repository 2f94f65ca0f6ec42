"""Compile the skinny kernels for sm_90 (H100) without a GPU and report what their K loops do.

Run as a script (``python tests/kernels/sm90_compile_check.py``) in a process without
``TRITON_INTERPRET``: Triton's NVIDIA backend lowers each kernel to PTX with the argument
specialisation a real launch gets (16-byte aligned pointers, sizes divisible by 16), and the
script prints one JSON line per variant: the K loop's ``bar.sync`` count (shared-memory
shuffles), its global loads, and whether the weight loads are 16-byte vectors.
``test_skinny_sm90.py`` runs it in CI; on a GPU the same kernels are compiled by the launches.
"""

from __future__ import annotations

import json
import re

import triton
from octavo.kernels.triton.fp8_gemv import _fp8_gemv_kernel
from octavo.kernels.triton.int4_gemv import _int4_gemv_kernel
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

TARGET = GPUTarget("cuda", 90, 32)
FP8_SIG = {"x_ptr": "*bf16", "w_ptr": "*fp8e4nv", "scale_ptr": "*fp32", "out_ptr": "*bf16",
           "M": "i32", "N": "i32", "K": "i32", "k_split": "i32", "stride_xm": "i32",
           "stride_wn": "i32", "BLOCK_M": "constexpr", "BLOCK_N": "constexpr",
           "BLOCK_K": "constexpr", "SPLIT_K": "constexpr", "UPCAST_DOT": "constexpr"}
INT4_SIG = {"x_ptr": "*bf16", "qweight_ptr": "*i32", "scales_ptr": "*fp16", "zeros_ptr": "*fp16",
            "g_idx_ptr": "*i32", "out_ptr": "*bf16", "M": "i32", "N": "i32", "K": "i32",
            "group_size": "i32", "k_split": "i32", "stride_xm": "i32",
            "HAS_G_IDX": "constexpr", "BLOCK_M": "constexpr", "BLOCK_N": "constexpr",
            "BLOCK_K": "constexpr", "SPLIT_K": "constexpr", "UPCAST_DOT": "constexpr"}
# Arguments a launch with Llama-3-8B shapes specialises as divisible by 16.
ALIGNED = ("x_ptr", "w_ptr", "scale_ptr", "out_ptr", "qweight_ptr", "scales_ptr", "zeros_ptr",
           "g_idx_ptr", "N", "K", "k_split", "stride_xm", "stride_wn", "group_size")


def loop_body(ptx: str) -> str:
    """The PTX of the first inner loop (from its header label to its back branch)."""
    match = re.search(r"Inner Loop Header(.*?)bra(?:\.uni)?\s+\$L__BB0_\d+;", ptx, re.DOTALL)
    return match.group(1) if match else ""


def compile_variant(fn, signature: dict, constexprs: dict, num_warps: int) -> dict:
    attrs = {(fn.arg_names.index(name),): [["tt.divisibility", 16]]
             for name in ALIGNED if name in signature}
    source = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    kernel = triton.compile(source, target=TARGET,
                            options={"num_warps": num_warps, "num_stages": 2})
    body = loop_body(kernel.asm["ptx"])
    return {"loop_barriers": body.count("bar.sync"),
            "loop_global_loads": len(re.findall(r"ld\.global", body)),
            "loop_vector_loads": len(re.findall(r"ld\.global(?:\.\w+)*\.v4\.b32", body))}


def main() -> None:
    for block_m in (1, 16):
        consts = {"BLOCK_M": block_m, "BLOCK_N": 16 if block_m == 1 else 32,
                  "BLOCK_K": 512 if block_m == 1 else 256, "SPLIT_K": 1, "UPCAST_DOT": False}
        print(json.dumps({"kernel": "fp8_gemv", **consts,
                          **compile_variant(_fp8_gemv_kernel, FP8_SIG, consts, 4)}))
        for has_g_idx in (False, True):
            consts = {"HAS_G_IDX": has_g_idx, "BLOCK_M": block_m,
                      "BLOCK_N": 128 if block_m == 1 else 64, "BLOCK_K": 128, "SPLIT_K": 2,
                      "UPCAST_DOT": False}
            signature = {**INT4_SIG, "out_ptr": "*fp32"}  # split-K: float32 atomics
            print(json.dumps({"kernel": "int4_gemv", **consts,
                              **compile_variant(_int4_gemv_kernel, signature, consts, 4)}))


if __name__ == "__main__":
    main()
