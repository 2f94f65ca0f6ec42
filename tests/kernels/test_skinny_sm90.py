"""The skinny kernels compile for the H100 (sm_90) in CI, and their one-row K loops keep the
properties the design relies on (``sm90_compile_check.py`` does the compiling, in a process
without the interpreter).

- they compile at all (the interpreter accepts programs the compiler refuses);
- the one-row loops have no ``bar.sync``: x and the group scales are loaded in the weight
  tile's register layout, not shuffled through shared memory each step;
- the weight loads are 16-byte vectors (``ld.global.v4.b32``);
- no register spills (no local-memory instructions in the SASS);
- at one row, launched with PDL: the first step's weight loads come before the grid-dependency
  wait, and the loops keep the properties above;
- split-K summed in the kernel: a barrier between the last program's reads of the totals and
  its zeroing of the workspace;
- the int4 one-row K loop stays under 3.6 SASS instructions per weight (it was ~5.5 before
  the ``prmt`` nibble unpacking; ~5 is where an H100 stops keeping up with memory), also
  with the words in 32-output panels (``octavo.kernels.int4.to_panels``);
- the fp8 one-row K loop over whole steps stays under 3.5 (~3.25: one e4m3x2 conversion
  per two weights, one widening and one FFMA per weight; ``x`` loaded once per thread, not
  per weight row it holds), and with its products summed over 16-input runs
  (``SkinnyConfig.sum_runs``) a 16 KiB tile takes at most 96 registers;
- pipelined one-row loops (``SkinnyConfig.load_stages``) copy later steps' weights ahead with
  16-byte ``cp.async`` and keep one copy of ``x`` per step in shared memory, not one per
  weight row (their loops do have barriers: the copies land in shared memory).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).with_name("sm90_compile_check.py")


def _nvidia_backend() -> bool:
    try:
        spec = importlib.util.find_spec("triton.backends.nvidia")
    except ModuleNotFoundError:
        return False
    if spec is None or spec.origin is None:
        return False
    return (Path(spec.origin).parent / "bin" / "ptxas").exists()


@pytest.mark.skipif(not _nvidia_backend(), reason="Triton's NVIDIA backend (ptxas) is not "
                    "installed")
def test_skinny_kernels_compile_for_sm90_without_barriers_in_one_row_loops():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    done = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True,
                          env=env, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    variants = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert len(variants) == 14, done.stdout
    # fp8 (whole steps, tail, runs, pipelined), int4 (plain, pipelined, panels)
    assert sum(v["USE_PDL"] for v in variants) == 7
    assert sum(v.get("PANELS", False) for v in variants) == 1
    for variant in variants:
        assert variant["local_memory_ops"] == 0, variant
        # With PDL: the grid-dependency trigger and wait, the first step's weights loaded
        # before the wait; without: neither.
        assert variant["grid_dependency_control"] == variant["USE_PDL"], variant
        assert (variant["loads_before_wait"] or 0) > 0 if variant["USE_PDL"] else \
            variant["loads_before_wait"] is None, variant
        # Split-K summed in the kernel: the last program reads every total before any of
        # its threads zeroes the workspace (the 16-row tiles read and zero in different
        # thread layouts).
        if variant.get("IN_KERNEL_SUM"):
            assert variant["barrier_before_zeroing"], variant
        pipelined = variant.get("LOAD_STAGES", 0) > 1
        if variant["BLOCK_M"] == 1 and not pipelined:
            assert variant["loop_barriers"] == 0, variant
            assert variant["loop_vector_loads"] >= 1, variant
        tile_bytes = variant["BLOCK_N"] * variant["BLOCK_K"] \
            // (2 if variant["kernel"] == "int4_gemv" else 1)
        if pipelined:
            # Later steps' weights copied ahead in 16-byte pieces; the buffers hold the
            # weight tiles and one copy of x (and the group's scales) per step, not a copy
            # per weight row
            assert variant["loop_async_copies"] >= 1, variant
            assert variant["shared_bytes"] <= \
                (variant["LOAD_STAGES"] - 1) * tile_bytes * 1.25, variant
        weights_per_thread = variant["BLOCK_N"] * variant["BLOCK_K"] / 128  # 4 warps
        if variant["kernel"] == "int4_gemv" and variant["BLOCK_M"] == 1 \
                and not variant["HAS_G_IDX"]:
            assert variant["loop_sass"] / weights_per_thread < 3.6, variant
        # The fp8 one-row loop over whole steps loads and converts x once per thread, not
        # once per row it holds (masked loads are not merged: 4.9 per weight, 12 loads)
        if variant["kernel"] == "fp8_gemv" and variant["BLOCK_M"] == 1 and variant["EVEN_K"] \
                and not variant["SUM_RUN"] and not pipelined:
            assert variant["loop_sass"] / weights_per_thread < 3.5, variant
            assert variant["loop_sass_global_loads"] <= 6, variant
        # Summed over 16-input runs, a 16 KiB tile takes ~70 registers (one float per weight:
        # ~200, one program per SM at 4 warps) for ~0.5 more instructions a weight
        if variant["kernel"] == "fp8_gemv" and variant["SUM_RUN"]:
            assert variant["registers"] <= 96, variant
            assert variant["loop_sass"] / weights_per_thread < 4.0, variant


@pytest.mark.skipif(not _nvidia_backend(), reason="Triton's NVIDIA backend (ptxas) is not "
                    "installed")
def test_decode_kernels_compile_for_sm90_with_programmatic_dependent_launch():
    """Every kernel ``octavo.kernels.triton.pdl`` launches with PDL compiles for an H100 with
    the grid-dependency wait and trigger in (``sm90_decode_compile_check.py``), the rotary
    kernel also in its variant that rotates the keys into the cache, and only the dense GEMV
    loads anything before its wait."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    script = Path(__file__).with_name("sm90_decode_compile_check.py")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          env=env, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    kernels = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert [k["kernel"] for k in kernels] == [
        "rms_norm", "rotary", "rotary+cache write", "write_kv", "decode partition",
        "decode reduce", "silu_and_mul", "dense_gemv", "dense_gemv late trigger, split",
        "argmax chunks", "argmax rows"]
    assert all(k["grid_dependency_control"] for k in kernels), kernels
    # The dense GEMV's weight tile is read before the wait; nothing else reads before it.
    assert {k["kernel"]: k["loads_before_wait"] > 0 for k in kernels} == {
        k["kernel"]: k["kernel"].startswith("dense_gemv") for k in kernels}
