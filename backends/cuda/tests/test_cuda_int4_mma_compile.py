"""The tensor-core int4 GEMV's CUDA source compiled by NVRTC for sm_80 and sm_90 without a GPU
(the ``nvidia-cuda-nvrtc`` wheel of ``make install-dev``), disassembled with Triton's bundled
``nvdisasm``: every launch config compiles, none spills to local memory, for sm_90 the first
group's words, scales and zeros load before the wait for the kernel before (PDL), also with the
words in 32-output panels, the late trigger (``EARLY_TRIGGER`` 0) comes after the sums, the
RMS norm inside the kernel (``NORM`` 1) leaves the loop reading shared memory, and the loop
over two groups spends what the source's header says (one LOP3 per nibble pair, one
``mma`` per 16x16 tile plus one for the sums of ``x``, few instructions a weight). What it
computes is checked on a GPU (``test_cuda_int4_mma.py``)."""

from __future__ import annotations

import collections
import re
import subprocess
import tempfile
from pathlib import Path

import pytest
import triton
from octavo_cuda import nvrtc
from octavo_cuda.int4_mma import CANDIDATES, MAX_NORM_K, MmaGemvConfig, _source

from tests.kernels.sm90_compile_check import sass_loops, sass_opcodes

BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"

try:
    nvrtc.require_nvrtc()
except nvrtc.NvrtcError as exc:  # pragma: no cover - make install-dev installs it
    pytest.skip(f"NVRTC is not installed here: {exc}", allow_module_level=True)

def _disassemble(cubin: bytes) -> tuple[str, str]:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as file:
        file.write(cubin)
        file.flush()
        sass = subprocess.run([str(BIN / "nvdisasm"), "-c", file.name], capture_output=True,
                              text=True, check=True).stdout
        usage = subprocess.run([str(BIN / "cuobjdump"), "--dump-resource-usage", file.name],
                               capture_output=True, text=True, check=True).stdout
    return sass, usage


def _group_loads(group: int) -> int:
    """Loads of one group's weights in a lane: rows g and g + 8 of each chunk of 32 inputs,
    then their scales and zeros (all weight loads skip L1: ``LDG.E.NA``)."""
    return 2 * group // 32 + 4


def _loop(sass: str) -> list[str]:
    """Opcodes of the longest loop: the two-group loop."""
    return sass_opcodes(max(sass_loops(sass), key=len))


@pytest.mark.parametrize("arch", [80, 90])
@pytest.mark.parametrize("bf16", [1, 0], ids=["bf16", "fp16"])
@pytest.mark.parametrize("config", [MmaGemvConfig(1, 1)] + CANDIDATES,
                         ids=lambda c: f"v{c.vec}w{c.warps}")
def test_every_config_compiles_without_spills(arch, bf16, config):
    for group in (32, 64, 128):
        cubin = nvrtc.compile_cubin(_source(), "int4_mma_gemv", arch,
                                    {"VEC": config.vec, "WARPS": config.warps, "GROUP": group,
                                     "BF16": bf16})
        sass, usage = _disassemble(cubin)
        assert re.search(r"STACK:0\b", usage) and re.search(r"LOCAL:0\b", usage), usage
        assert "HMMA.16816.F32" in sass
        if arch >= 90:
            # programmatic dependent launch: the first group's words, scales and zeros load
            # before the wait (ACQBULK, griddepcontrol.wait), x only after it
            before, _, after = sass.partition("ACQBULK")
            assert len(re.findall(r"LDG\.E\.NA\b", before)) == _group_loads(group)
            assert "PREEXIT" in after and re.search(r"LDG\.E\.128 ", after)
            assert not re.search(r"LDG\.E\.128 ", before)
        else:
            assert "ACQBULK" not in sass
        # every scale and zero comes through the group pipeline: none is loaded where it is
        # used (a memory round trip after each group's sums; they were, before)
        assert not re.search(r"LDG\.E\.(U16\.)?CONSTANT", sass)


@pytest.mark.parametrize("vec, per_weight", [(1, 2.6), (2, 2.0), (4, 1.7)])
def test_the_group_loop_costs_what_the_header_says(vec, per_weight):
    """sm_90, groups of 128: per thread and group, 4 chunks x 2 word rows x ``vec`` words
    (8 nibbles each): 4 LOP3 a word (mask and magic number in one), 2 mma per word and
    k-tile pair, 2 for the sums of x per chunk (two groups per loop trip)."""
    cubin = nvrtc.compile_cubin(_source(), "int4_mma_gemv", 90,
                                {"VEC": vec, "WARPS": 8, "GROUP": 128, "BF16": 1})
    ops = collections.Counter(_loop(_disassemble(cubin)[0]))
    words = 2 * 4 * 2 * vec  # two groups, four chunks, rows g and g + 8
    assert ops["HMMA"] == 2 * 4 * 2 * (vec + 1)
    assert ops["LOP3"] <= 4 * words + 4
    assert ops["SHF"] <= 3 * words + 4
    assert sum(ops.values()) / (8 * words) <= per_weight, ops.most_common(8)


@pytest.mark.parametrize("config", CANDIDATES, ids=lambda c: f"v{c.vec}w{c.warps}")
def test_panels_compile_to_the_same_loop(config):
    """sm_90, groups of 128, the words in 32-output panels: no spills, the first group's words
    before the PDL wait, and the two-group loop no longer than with GPTQ's rows (only the
    pointers' strides differ)."""
    macros = {"VEC": config.vec, "WARPS": config.warps, "GROUP": 128, "BF16": 1}
    rows = _disassemble(nvrtc.compile_cubin(_source(), "int4_mma_gemv", 90, macros))[0]
    sass, usage = _disassemble(nvrtc.compile_cubin(_source(), "int4_mma_gemv", 90,
                                                   {**macros, "PANELS": 1}))
    assert re.search(r"STACK:0\b", usage) and re.search(r"LOCAL:0\b", usage), usage
    before = sass.partition("ACQBULK")[0]
    assert len(re.findall(r"LDG\.E\.NA\b", before)) == _group_loads(128)
    assert len(_loop(sass)) <= len(_loop(rows))


@pytest.mark.parametrize("config", CANDIDATES, ids=lambda c: f"v{c.vec}w{c.warps}")
def test_the_late_trigger_comes_after_the_sums(config):
    """``EARLY_TRIGGER`` 0 (``MmaGemvConfig.early_trigger``), sm_90, panels: the next kernel's
    launch (``PREEXIT``) after the group loop's last ``mma`` and before the warps' partials
    meet in shared memory, with the registers of the early trigger and no spills."""
    macros = {"VEC": config.vec, "WARPS": config.warps, "GROUP": 128, "BF16": 1, "PANELS": 1}
    early, early_usage = _disassemble(nvrtc.compile_cubin(_source(), "int4_mma_gemv", 90,
                                                          macros))
    late, usage = _disassemble(nvrtc.compile_cubin(_source(), "int4_mma_gemv", 90,
                                                   {**macros, "EARLY_TRIGGER": 0}))
    assert re.search(r"STACK:0\b", usage) and re.search(r"LOCAL:0\b", usage), usage
    assert re.search(r"REG:\d+", usage).group() == re.search(r"REG:\d+", early_usage).group()
    ops = [op for op in sass_opcodes(late) if op in ("PREEXIT", "HMMA", "STS", "ACQBULK")]
    assert ops.count("PREEXIT") == 1
    preexit = ops.index("PREEXIT")
    assert "HMMA" not in ops[preexit:] and "HMMA" in ops[:preexit]
    if config.warps > 1:
        assert "STS" in ops[preexit:] and "STS" not in ops[:preexit]
    ops = [op for op in sass_opcodes(early) if op in ("PREEXIT", "HMMA", "ACQBULK")]
    assert ops.index("PREEXIT") < ops.index("HMMA")


@pytest.mark.parametrize("arch", [80, 90])
@pytest.mark.parametrize("config", CANDIDATES, ids=lambda c: f"v{c.vec}w{c.warps}")
def test_the_norm_in_the_gemv_compiles_and_reads_x_from_shared_memory(arch, config):
    """``NORM`` 1 (``int4_mma_gemv_add_rms_norm``), panels, both dtypes, Llama-3-8B's row and
    the longest: no spills; for sm_90 the first group's weights and the norm weight's vectors
    (one a ``NORM_ITEMS``) still load before the PDL wait, and ``x`` and the residual after it
    not through the read-only path; the group loop reads the normed row from shared memory
    (``LDS.128``), no ``x`` from global memory."""
    for bf16, norm_k in ((1, 4096), (0, 4096), (1, MAX_NORM_K)):
        sass, usage = _disassemble(nvrtc.compile_cubin(
            _source(), "int4_mma_gemv", arch, {"VEC": config.vec, "WARPS": config.warps,
                                               "GROUP": 128, "BF16": bf16, "PANELS": 1,
                                               "NORM": 1, "NORM_K": norm_k}))
        assert re.search(r"STACK:0\b", usage) and re.search(r"LOCAL:0\b", usage), usage
        loop = _loop(sass)
        assert "LDS" in loop and "HMMA" in loop
        assert not re.search(r"LDG\.E\.128 ", max(sass_loops(sass), key=len))
        if arch >= 90:
            before, _, after = sass.partition("ACQBULK")
            assert len(re.findall(r"LDG\.E\.NA\b", before)) == _group_loads(128)
            norm_items = -(-norm_k // (config.warps * 256))
            assert len(re.findall(r"LDG\.E\.128\.CONSTANT\b", before)) == norm_items
            assert len(re.findall(r"LDG\.E\.128 ", after.split("HMMA")[0])) == 2 * norm_items
            assert "CONSTANT" not in after


def test_a_source_that_does_not_compile_raises_with_nvrtcs_log():
    with pytest.raises(nvrtc.NvrtcError, match="int4_mma_gemv.*undefined_name"):
        nvrtc.compile_cubin(_source() + "\n__global__ void broken() { undefined_name(); }\n",
                            "int4_mma_gemv", 90, {})
