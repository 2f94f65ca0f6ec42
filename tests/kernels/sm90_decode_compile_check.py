"""Compile the decode step's PDL-launched Triton kernels for sm_90 (H100) without a GPU.

Run as a script in a process without ``TRITON_INTERPRET`` (``test_skinny_sm90.py`` runs it in
CI): each kernel of ``octavo.kernels.triton.pdl``'s list is lowered with ``USE_PDL`` on (as on
an H100), the rotary kernel in both variants (plain, and rotating the keys into the cache),
and one JSON line per kernel says whether its PTX has the grid-dependency wait and trigger,
and how many global loads come before the wait (none but the one-row dense GEMV's weight
tile: every other kernel waits before it reads).
Pointers are bf16 unless named below, other arguments int32 or (named) float32.
"""

from __future__ import annotations

import json

import triton
from octavo.kernels.triton.activation import _silu_and_mul_kernel
from octavo.kernels.triton.argmax import _chunk_argmax_kernel, _row_argmax_kernel
from octavo.kernels.triton.cache_write import _write_kv_kernel
from octavo.kernels.triton.decode_attention import (
    _decode_partition_kernel,
    _decode_reduce_kernel,
)
from octavo.kernels.triton.dense_gemv import _dense_gemv_kernel
from octavo.kernels.triton.rmsnorm import _rms_norm_kernel
from octavo.kernels.triton.rotary import _rotary_kernel
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

TARGET = GPUTarget("cuda", 90, 32)
POINTER_TYPES = {
    "positions_ptr": "*i64", "slot_mapping_ptr": "*i64", "cos_sin_ptr": "*fp32",
    "part_acc_ptr": "*fp32", "part_max_ptr": "*fp32", "part_sum_ptr": "*fp32",
    "block_tables_ptr": "*i32", "seq_lens_ptr": "*i32", "query_start_loc_ptr": "*i32",
    "sums_ptr": "*fp32", "arrivals_ptr": "*i32",
    "chunk_max_ptr": "*fp32", "chunk_index_ptr": "*i64", "tokens_ptr": "*i64",
}
FLOATS = {"eps", "scale_log2", "soft_cap", "v_scale", "k_inv_scale", "v_inv_scale"}

CASES = [
    ("rms_norm", _rms_norm_kernel,
     {"HAS_RESIDUAL": True, "BLOCK": 1024, "EMULATE_BF16": False}),
    ("rotary", _rotary_kernel,
     {"BLOCK_H": 16, "HALF_PADDED": 64, "EMULATE_BF16": False, "WRITE_CACHE": False,
      "CACHE_BLOCK_SIZE": 1}),
    ("rotary+cache write", _rotary_kernel,
     {"BLOCK_H": 16, "HALF_PADDED": 64, "EMULATE_BF16": False, "WRITE_CACHE": True,
      "CACHE_BLOCK_SIZE": 16}),
    ("write_kv", _write_kv_kernel,
     {"CACHE_BLOCK_SIZE": 16, "HEADS_PADDED": 8, "HEAD_DIM_PADDED": 128, "QUANTIZE_FP8": False}),
    ("decode partition", _decode_partition_kernel,
     {"GROUP": 4, "ROWS": 16, "HEAD_DIM_PADDED": 128, "BLOCK_N": 64, "CACHE_BLOCK_SIZE": 16,
      "SINGLE_PARTITION": False, "UPCAST_DOT": False, "DOT_PRECISION": "ieee",
      "SLIDING": False, "SOFT_CAP": False}),
    ("decode reduce", _decode_reduce_kernel,
     {"BLOCK_N": 64, "BLOCK_P": 16, "HEAD_DIM_PADDED": 128, "SLIDING": False}),
    ("silu_and_mul", _silu_and_mul_kernel, {"BLOCK": 1024, "EMULATE_BF16": False}),
    ("dense_gemv", _dense_gemv_kernel,
     {"HAS_BIAS": True, "BLOCK_N": 4, "BLOCK_K": 2048, "SPLIT_K": 1, "IN_KERNEL_SUM": False,
      "EARLY_TRIGGER": True, "EVEN_K": False, "EVEN_N": True, "SUM_RUN": 0,
      "LOAD_STAGES": 0}),
    ("dense_gemv late trigger, split", _dense_gemv_kernel,
     {"HAS_BIAS": False, "BLOCK_N": 8, "BLOCK_K": 512, "SPLIT_K": 4, "IN_KERNEL_SUM": True,
      "EARLY_TRIGGER": False, "EVEN_K": True, "EVEN_N": True, "SUM_RUN": 8,
      "LOAD_STAGES": 0}),
    ("argmax chunks", _chunk_argmax_kernel, {"BLOCK": 8192}),
    ("argmax rows", _row_argmax_kernel, {"CHUNKS": 32}),
]


def signature_of(fn, constexprs: dict) -> dict:
    signature = {}
    for name in fn.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name.endswith("_ptr"):
            signature[name] = POINTER_TYPES.get(name, "*bf16")
        else:
            signature[name] = "fp32" if name in FLOATS else "i32"
    return signature


def main() -> None:
    for name, fn, constexprs in CASES:
        constexprs = {**constexprs, "USE_PDL": True}
        source = ASTSource(fn=fn, signature=signature_of(fn, constexprs), constexprs=constexprs)
        kernel = triton.compile(source, target=TARGET, options={"num_warps": 4})
        ptx = kernel.asm["ptx"]
        wait = ptx.find("griddepcontrol.wait")
        print(json.dumps({"kernel": name, "grid_dependency_control": all(
            op in ptx for op in ("griddepcontrol.launch_dependents", "griddepcontrol.wait")),
            "loads_before_wait": ptx[:wait].count("ld.global") if wait >= 0 else None}))


if __name__ == "__main__":
    main()
