"""Compile the skinny kernels for sm_90 (H100) without a GPU and report what their K loops do.

Run as a script (``python tests/kernels/sm90_compile_check.py``) in a process without
``TRITON_INTERPRET``: Triton's NVIDIA backend lowers each kernel with the argument
specialisation a real launch gets (16-byte aligned pointers, sizes divisible by 16; the
int4 kernel's compile-time arguments from ``int4_gemv.kernel_constexprs``), and the script
prints one JSON line per variant: the K loop's ``bar.sync`` count (shared-memory shuffles),
its global loads (in the PTX, and in the SASS, where ``ptxas`` has merged repeated unmasked
loads), whether the weight loads are 16-byte vectors, the kernel's local-memory
instructions (register spills), its registers per thread and the SASS instructions of the loop (disassembled with
Triton's bundled ``nvdisasm``). ``test_skinny_sm90.py`` runs it in CI; on a GPU the same
kernels are compiled by the launches.
"""

from __future__ import annotations

import inspect
import json
import re
import subprocess
import tempfile
from pathlib import Path

import torch
import triton
from octavo.kernels.triton.fp8_gemv import _fp8_gemv_kernel
from octavo.kernels.triton.int4_gemv import _int4_gemv_kernel, kernel_constexprs
from octavo.kernels.triton.skinny_gemm import SkinnyConfig
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

TARGET = GPUTarget("cuda", 90, 32)
NVDISASM = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
CUOBJDUMP = NVDISASM.with_name("cuobjdump")
FP8_SIG = {"x_ptr": "*bf16", "w_ptr": "*fp8e4nv", "scale_ptr": "*fp32", "out_ptr": "*bf16",
           "sums_ptr": "*fp32", "arrivals_ptr": "*i32", "M": "i32", "N": "i32", "K": "i32", "k_split": "i32", "stride_xm": "i32",
           "stride_wn": "i32", "BLOCK_M": "constexpr", "BLOCK_N": "constexpr",
           "BLOCK_K": "constexpr", "SPLIT_K": "constexpr", "IN_KERNEL_SUM": "constexpr",
           "UPCAST_DOT": "constexpr", "USE_PDL": "constexpr"}
INT4_SIG = {"x_ptr": "*bf16", "qweight_ptr": "*i32", "scales_ptr": "*fp16", "zeros_ptr": "*fp16",
            "g_idx_ptr": "*i32", "out_ptr": "*bf16", "sums_ptr": "*fp32",
            "arrivals_ptr": "*i32", "M": "i32", "N": "i32", "K": "i32",
            "k_split": "i32", "stride_xm": "i32"}
# Arguments a launch with Llama-3-8B shapes specialises as divisible by 16.
ALIGNED = ("x_ptr", "w_ptr", "scale_ptr", "out_ptr", "sums_ptr", "arrivals_ptr", "qweight_ptr", "scales_ptr", "zeros_ptr",
           "g_idx_ptr", "N", "K", "k_split", "stride_xm", "stride_wn")


def int4_constexprs(m: int, config: SkinnyConfig, has_g_idx: bool = False, split: int = 2,
                    dtype: torch.dtype = torch.bfloat16, use_pdl: bool = False) -> dict:
    """What a launch of ``int4_gemv`` at N = K = 4096, group 128, with ``m`` rows compiles
    (a split summed in the kernel, as launches with the workspace are)."""
    x = torch.empty(m, 4096, dtype=dtype)  # on the CPU: only its dtype and alignment count
    return {**kernel_constexprs(x, 4096, 4096, 128, has_g_idx, config, split, use_pdl),
            "IN_KERNEL_SUM": split > 1}


def compile_kernel(fn, signature: dict, constexprs: dict, num_warps: int, num_stages: int = 2):
    # compile-time parameters a launch leaves out take their defaults
    constexprs = {**{p.name: p.default for p in fn.params
                     if p.is_constexpr and p.default is not inspect.Parameter.empty},
                  **constexprs}
    signature = {**signature, **{name: "constexpr" for name in constexprs}}
    attrs = {(fn.arg_names.index(name),): [["tt.divisibility", 16]]
             for name in ALIGNED if name in signature}
    source = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(source, target=TARGET,
                          options={"num_warps": num_warps, "num_stages": num_stages})


def sass(kernel) -> str:
    """The kernel's SASS (``nvdisasm`` of its cubin)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(kernel.asm["cubin"])
        cubin.flush()
        return subprocess.run([str(NVDISASM), "-c", cubin.name], capture_output=True,
                              text=True, check=True).stdout


_INSTRUCTION = re.compile(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)")


def sass_opcodes(text: str) -> list[str]:
    """The opcodes of the SASS instructions in ``text``, in order."""
    return [m.group(1) for m in map(_INSTRUCTION.match, text.splitlines()) if m]


def sass_loops(text: str) -> list[str]:
    """The SASS of each loop, in order: from the label a backward branch jumps to, to that
    branch."""
    lines = text.splitlines()
    labels, loops = {}, []
    for i, line in enumerate(lines):
        label = re.match(r"^(\.L\w+):", line)
        if label:
            labels[label.group(1)] = i
        branch = re.search(r"\bBRA\s+`?\(?(\.L\w+)\)?", line)
        if branch and labels.get(branch.group(1), i) < i:
            loops.append("\n".join(lines[labels[branch.group(1)]:i + 1]))
    return loops


def sass_loop(text: str) -> str:
    """The SASS of the first loop ("" when there is none)."""
    loops = sass_loops(text)
    return loops[0] if loops else ""


def loop_body(ptx: str) -> str:
    """The PTX of the first inner loop (from its header label to its back branch)."""
    match = re.search(r"Inner Loop Header(.*?)bra(?:\.uni)?\s+\$L__BB0_\d+;", ptx, re.DOTALL)
    return match.group(1) if match else ""


def barrier_before_zeroing(ptx: str) -> bool | None:
    """Whether the split-K epilogue's last program has a ``bar.sync`` between its reads of
    the totals (the last ``ld.global.cg``) and its last store before resetting the arrival
    count (the workspace's zeroing); None without such an epilogue."""
    load = ptx.rfind("ld.global.cg")
    reset = ptx.find("exch", load)
    if load < 0 or reset < 0:
        return None
    return "bar.sync" in ptx[load:ptx.rfind("st.global", load, reset)]


def registers(kernel) -> int:
    """Registers per thread of the kernel (``cuobjdump --dump-resource-usage``)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(kernel.asm["cubin"])
        cubin.flush()
        usage = subprocess.run([str(CUOBJDUMP), "--dump-resource-usage", cubin.name],
                               capture_output=True, text=True, check=True).stdout
    return int(re.search(r"REG:(\d+)", usage).group(1))


def compile_variant(fn, signature: dict, constexprs: dict, num_warps: int) -> dict:
    kernel = compile_kernel(fn, signature, constexprs, num_warps)
    body = loop_body(kernel.asm["ptx"])
    code = sass(kernel)
    ptx = kernel.asm["ptx"]
    wait = ptx.find("griddepcontrol.wait")
    return {"grid_dependency_control": "griddepcontrol.launch_dependents" in ptx and wait >= 0,
            "loads_before_wait": ptx[:wait].count("ld.global") if wait >= 0 else None,
            "barrier_before_zeroing": barrier_before_zeroing(ptx),
            "loop_barriers": body.count("bar.sync"),
            "loop_global_loads": len(re.findall(r"ld\.global", body)),
            # 16-byte copies to shared memory issued ahead (pipelined loops)
            "loop_async_copies": len(re.findall(r"cp\.async\.cg\.shared\.global\s+\[[^]]+\], "
                                                r"\[[^]]+\], 0x10\b", body)),
            "shared_bytes": kernel.metadata.shared,
            "loop_vector_loads": len(re.findall(r"ld\.global(?:\.\w+)*\.v4\.b32", body)),
            "local_memory_ops": sum(op in ("LDL", "STL") for op in sass_opcodes(code)),
            "loop_sass": len(sass_opcodes(sass_loop(code))),
            "loop_sass_global_loads": sass_opcodes(sass_loop(code)).count("LDG"),
            "registers": registers(kernel)}


def main() -> None:
    # (rows, launched with PDL): PDL is for one row only (octavo.kernels.triton.pdl)
    for block_m, use_pdl in ((1, False), (1, True), (16, False)):
        # whole steps (Llama-3-8B's shapes), and at one row also a masked tail
        for even in (True, False) if block_m == 1 else (True,):
            consts = {"BLOCK_M": block_m, "BLOCK_N": 16 if block_m == 1 else 32,
                      "BLOCK_K": 512 if block_m == 1 else 256, "SPLIT_K": 1,
                      "IN_KERNEL_SUM": False, "UPCAST_DOT": False, "EARLY_TRIGGER": True,
                      "EVEN_K": even, "EVEN_N": even, "SUM_RUN": 0, "LOAD_STAGES": 0,
                      "USE_PDL": use_pdl}
            print(json.dumps({"kernel": "fp8_gemv", **consts,
                              **compile_variant(_fp8_gemv_kernel, FP8_SIG, consts, 4)}))
        for has_g_idx in (False, True):
            if use_pdl and has_g_idx:
                continue  # act-order launches without PDL
            config = SkinnyConfig(128 if block_m == 1 else 64, 128)
            consts = int4_constexprs(block_m, config, has_g_idx, use_pdl=use_pdl)
            signature = INT4_SIG  # split-K summed in the kernel: bf16 out, float32 sums
            print(json.dumps({"kernel": "int4_gemv", **consts,
                              **compile_variant(_int4_gemv_kernel, signature, consts, 4)}))
    # A 16 KiB tile per step whose products are summed over each thread's 16-input runs
    # (SkinnyConfig.sum_runs)
    consts = {"BLOCK_M": 1, "BLOCK_N": 16, "BLOCK_K": 1024, "SPLIT_K": 1, "IN_KERNEL_SUM": False,
              "UPCAST_DOT": False, "EARLY_TRIGGER": True, "EVEN_K": True, "EVEN_N": True,
              "SUM_RUN": 16, "LOAD_STAGES": 0, "USE_PDL": True}
    print(json.dumps({"kernel": "fp8_gemv", **consts,
                      **compile_variant(_fp8_gemv_kernel, FP8_SIG, consts, 4)}))
    # Pipelined one-row loops (SkinnyConfig.load_stages), with PDL
    consts = {**consts, "BLOCK_K": 512, "SUM_RUN": 0, "LOAD_STAGES": 3}
    print(json.dumps({"kernel": "fp8_gemv", **consts,
                      **compile_variant(_fp8_gemv_kernel, FP8_SIG, consts, 4)}))
    consts = int4_constexprs(1, SkinnyConfig(128, 128, load_stages=4), use_pdl=True)
    print(json.dumps({"kernel": "int4_gemv", **consts,
                      **compile_variant(_int4_gemv_kernel, INT4_SIG, consts, 4)}))
    # The words in 32-output panels (octavo.kernels.int4.to_panels), one row with PDL
    consts = {**int4_constexprs(1, SkinnyConfig(128, 128), use_pdl=True), "PANELS": True}
    print(json.dumps({"kernel": "int4_gemv", **consts,
                      **compile_variant(_int4_gemv_kernel, INT4_SIG, consts, 4)}))


if __name__ == "__main__":
    main()
