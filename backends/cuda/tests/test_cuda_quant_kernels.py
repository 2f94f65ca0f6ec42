"""The CUDA backend's answer to ``octavo_quant_kernels`` (runs without a GPU: which kernels it
offers, and what its ``int4_matmul`` declines)."""

from __future__ import annotations

import ctypes
import logging

import pytest
import torch
from octavo_cuda import nvrtc, quant
from octavo_cuda.int4_mma import (
    CANDIDATES,
    MmaGemvConfig,
    default_config,
    operands_supported,
    supports,
)
from octavo_cuda.plugin import plugin


def test_int4_methods_get_the_tensor_core_gemv_unless_turned_off(monkeypatch, caplog):
    monkeypatch.setattr(nvrtc, "_nvrtc", lambda: object())
    monkeypatch.delenv("OCTAVO_CUDA_INT4_MMA", raising=False)
    with caplog.at_level(logging.INFO, logger="octavo_cuda.quant"):
        assert isinstance(quant.quant_kernels("gptq"), quant.Int4Kernels)
    assert "tensor-core GEMV" in caplog.text
    assert isinstance(quant.quant_kernels("awq"), quant.Int4Kernels)
    assert quant.quant_kernels("fp8") is None and quant.quant_kernels("gguf") is None
    monkeypatch.setenv("OCTAVO_CUDA_INT4_MMA", "0")
    assert quant.quant_kernels("gptq") is None
    monkeypatch.setenv("OCTAVO_CUDA_INT4_MMA", "1")
    assert isinstance(quant.quant_kernels("gptq"), quant.Int4Kernels)


def test_without_nvrtc_the_triton_kernels_run_and_the_log_says_why(monkeypatch, caplog):
    def missing():
        raise nvrtc.NvrtcError("libnvrtc (CUDA's runtime compiler) was not found")

    monkeypatch.setenv("OCTAVO_CUDA_INT4_MMA", "1")
    monkeypatch.setattr(nvrtc, "_nvrtc", missing)
    with caplog.at_level(logging.WARNING, logger="octavo_cuda.quant"):
        assert quant.quant_kernels("gptq") is None
    assert "libnvrtc" in caplog.text and "Triton int4_gemv" in caplog.text


def test_the_plugin_answers_the_hook_for_its_own_backend_only(monkeypatch):
    monkeypatch.setenv("OCTAVO_CUDA_INT4_MMA", "1")
    monkeypatch.setattr(nvrtc, "_nvrtc", lambda: object())
    assert isinstance(plugin.octavo_quant_kernels("cuda", "gptq"), quant.Int4Kernels)
    assert plugin.octavo_quant_kernels("rocm", "gptq") is None


def test_the_default_config_is_a_candidate_that_won_on_the_h100():
    # each Llama-3-8B projection's best launch in bench_int4_mma.py's H100 sweep (132 SMs),
    # at every row count
    won = {(6144, 4096): MmaGemvConfig(2, 8), (4096, 4096): MmaGemvConfig(2, 16),
           (28672, 4096): MmaGemvConfig(2, 4), (4096, 14336): MmaGemvConfig(2, 16)}
    for (n, k), config in won.items():
        assert default_config(n, k, 132) == config
    for sms in (46, 108, 132, 142):  # spill-free and dividing N, whatever the shape
        for n in range(16, 40000, 16):
            config = default_config(n, 4096, sms)
            assert config in CANDIDATES and n % (16 * config.vec) == 0


@pytest.mark.parametrize("case", ["cpu", "16 rows", "float32", "act-order", "group 8",
                                  "group 256", "N=24", "float32 scales", "strided scales",
                                  "scales off 8 bytes"])
def test_int4_matmul_declines_what_the_kernel_does_not_run(case):
    """Each of these goes back to ``int4_linear``'s Triton/torch paths (``None``): the
    operands it does not take, and operands it takes but on the CPU."""
    x = torch.zeros(1, 256, dtype=torch.bfloat16)
    qweight = torch.zeros(32, 32, dtype=torch.int32)
    scales = zeros = torch.zeros(2, 32, dtype=torch.float16)
    g_idx, group_size = None, 128
    if case == "16 rows":
        x = torch.zeros(16, 256, dtype=torch.bfloat16)
    elif case == "float32":
        x = x.float()
    elif case == "act-order":
        g_idx = torch.zeros(256, dtype=torch.int32)
    elif case == "group 8":
        group_size = 8
    elif case == "group 256":  # two groups' words would not fit in registers
        group_size = 256
    elif case == "N=24":
        qweight = torch.zeros(32, 24, dtype=torch.int32)
    elif case == "float32 scales":
        scales = scales.float()
    elif case == "strided scales":  # read as [G, N] rows
        scales = torch.zeros(32, 2, dtype=torch.float16).t()
    elif case == "scales off 8 bytes":  # up to four float16 in one load
        scales = torch.zeros(2 * 32 + 1, dtype=torch.float16)[1:].view(2, 32)
    assert operands_supported(x, qweight, scales, zeros, group_size, g_idx) == (case == "cpu")
    assert not supports(x, qweight, scales, zeros, group_size, g_idx)
    assert quant.Int4Kernels.int4_matmul(x, qweight, scales, zeros, group_size, g_idx) is None


def test_the_backend_asks_for_panels_for_the_layers_its_gemv_takes(monkeypatch):
    """``int4_prepare_qweight``: 32-output panels where the tensor-core GEMV runs the layer,
    GPTQ's rows elsewhere and with ``OCTAVO_CUDA_INT4_PANELS=0``; operands in panels are
    taken like the rows they hold."""
    from octavo.kernels.int4 import from_panels, is_panels

    monkeypatch.delenv("OCTAVO_CUDA_INT4_PANELS", raising=False)
    qweight = torch.arange(32 * 64, dtype=torch.int32).reshape(32, 64)
    panels = quant.Int4Kernels.int4_prepare_qweight(qweight, 128, None)
    assert is_panels(panels) and torch.equal(from_panels(panels), qweight)
    x = torch.zeros(1, 256, dtype=torch.bfloat16)
    scales = zeros = torch.zeros(2, 64, dtype=torch.float16)
    assert operands_supported(x, panels, scales, zeros, 128, None)
    kept = [(qweight, 128, torch.zeros(256, dtype=torch.int32)),  # act-order
            (qweight, 256, None),  # groups the GEMV does not take
            (torch.zeros(32, 48, dtype=torch.int32), 128, None)]  # N not a multiple of 32
    for words, group_size, g_idx in kept:
        assert quant.Int4Kernels.int4_prepare_qweight(words, group_size, g_idx) is words
    monkeypatch.setenv("OCTAVO_CUDA_INT4_PANELS", "0")
    assert quant.Int4Kernels.int4_prepare_qweight(qweight, 128, None) is qweight


class _FakeDriver:
    """``cuLaunchKernelEx`` that records what a launch passes (read back through ctypes)."""

    def __init__(self) -> None:
        self.launches: list[dict] = []

    def cuLaunchKernelEx(self, config_ref, function, params, extra):
        config = ctypes.cast(config_ref, ctypes.POINTER(nvrtc._LaunchConfig)).contents
        attrs = [(config.attrs[i].id, config.attrs[i].value.flag)
                 for i in range(config.num_attrs)]
        values = [ctypes.cast(params[i], ctypes.POINTER(ctypes.c_int64)).contents.value
                  for i in range(3)]
        self.launches.append({
            "grid": (config.grid_x, config.grid_y, config.grid_z),
            "block": (config.block_x, config.block_y, config.block_z),
            "shared": config.shared_bytes, "stream": config.stream, "attrs": attrs,
            "function": function.value, "pointer": values[0],
            "int": values[1] & 0xFFFFFFFF, "float": ctypes.cast(
                params[2], ctypes.POINTER(ctypes.c_float)).contents.value})
        return 0


def test_a_launch_passes_grid_block_stream_pdl_and_arguments_as_the_driver_reads_them(
        monkeypatch):
    driver = _FakeDriver()
    monkeypatch.setattr(nvrtc, "_driver", lambda: driver)
    kernel = nvrtc.CompiledKernel(function=0xABC, device=0, name="k")
    tensor = torch.zeros(4)
    kernel.launch((96, 1, 1), (256, 1, 1), [tensor, 4096, 0.5], shared_bytes=128, pdl=True,
                  stream=1234)
    kernel.launch((2, 3, 4), (32, 1, 1), [tensor, -1, 2.0], stream=99)
    first, second = driver.launches
    assert first["grid"] == (96, 1, 1) and first["block"] == (256, 1, 1)
    assert first["shared"] == 128 and first["stream"] == 1234 and first["function"] == 0xABC
    # programmatic stream serialization (id 6) allowed
    assert first["attrs"] == [(nvrtc._PROGRAMMATIC_STREAM_SERIALIZATION, 1)]
    assert first["pointer"] == tensor.data_ptr() and first["int"] == 4096
    assert first["float"] == 0.5
    assert second["attrs"] == [] and second["grid"] == (2, 3, 4) and second["stream"] == 99
    assert second["int"] == 0xFFFFFFFF and second["float"] == 2.0
    with pytest.raises(TypeError, match="unsupported kernel argument str"):
        kernel.launch((1, 1, 1), (32, 1, 1), ["x"], stream=1)



def test_a_model_gets_the_device_tables_configs_and_the_default_elsewhere(monkeypatch):
    """``chosen_config`` (what ``int4_mma_gemv`` and ``bench_int4_mma.py --chain`` start from)
    looks a case up under the key the H100 table was written with; a case the table lacks
    gets ``default_config``."""
    from octavo.kernels.triton import skinny_gemm
    from octavo_cuda import int4_mma

    table = skinny_gemm.read_config_table(
        skinny_gemm.CONFIG_DIR / "skinny_NVIDIA_H100_80GB_HBM3.json")
    cases = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]
    keys = [skinny_gemm.tune_key(n=n, k=k, m=1, dtype=torch.bfloat16, group=128)
            for n, k in cases]
    assert all(key in table["int4_mma_gemv"] for key in keys)
    # a table whose entries no default would give: each case finds its own
    marked = {key: MmaGemvConfig(vec=1, warps=4 + i).as_skinny() for i, key in enumerate(keys)}
    monkeypatch.setattr(skinny_gemm, "_device_table", lambda index: {"int4_mma_gemv": marked})
    monkeypatch.setattr(skinny_gemm, "interpreting", lambda: False)
    monkeypatch.setattr(int4_mma, "_sms", lambda index: 132)
    monkeypatch.setattr(int4_mma, "TUNER", skinny_gemm.SkinnyTuner("int4_mma_gemv"))
    gpu = torch.device("cuda", 0)
    for i, (n, k) in enumerate(cases):
        assert int4_mma.chosen_config(n, k, 1, torch.bfloat16, 128, gpu) \
            == MmaGemvConfig(vec=1, warps=4 + i)
    assert int4_mma.chosen_config(4096, 4096, 1, torch.bfloat16, 64, gpu) \
        == default_config(4096, 4096, 132)  # groups of 64: no entry


def test_the_norm_in_the_gemv_takes_one_aligned_row_of_one_dtype():
    """``norm_supported``: what ``int4_mma_gemv_add_rms_norm`` takes beyond the GEMV's
    operands (one row, at most ``MAX_NORM_K`` values in shared memory, one dtype, 16-byte
    aligned contiguous vectors); anything else keeps the norm kernel."""
    from octavo_cuda.int4_mma import MAX_NORM_K, norm_supported

    def operands(k=4096, rows=1, dtype=torch.bfloat16):
        return (torch.zeros(rows, k, dtype=dtype), torch.zeros(rows, k, dtype=dtype),
                torch.zeros(k, dtype=dtype))

    assert norm_supported(*operands())
    assert norm_supported(*operands(k=MAX_NORM_K))
    assert not norm_supported(*operands(k=MAX_NORM_K + 128))
    assert not norm_supported(*operands(rows=2))
    x, residual, weight = operands()
    assert not norm_supported(x, residual.float(), weight)
    assert not norm_supported(x, residual, weight.half())
    unaligned = torch.zeros(4096 + 4, dtype=torch.bfloat16)[4:].view(1, 4096)  # 8 bytes in
    assert not norm_supported(unaligned, residual, weight)
    strided = torch.zeros(4096, 2, dtype=torch.bfloat16).t()[:1]  # [1, 4096], stride 2
    assert not norm_supported(strided, residual, weight)
    assert norm_supported(x, x, weight)  # the first layer: the input is its own residual


def test_the_norm_goes_into_the_gemv_by_default_when_taken(monkeypatch):
    """The int4 methods get ``int4_matmul_add_rms_norm``'s fused kernel (on by default,
    ``OCTAVO_CUDA_INT4_NORM=0`` turns it off); it declines what the GEMV or the norm operands
    do not take."""
    monkeypatch.setattr(nvrtc, "_nvrtc", lambda: object())
    monkeypatch.setenv("OCTAVO_CUDA_INT4_NORM", "0")
    assert quant.quant_kernels("gptq").fused_norm is False
    monkeypatch.delenv("OCTAVO_CUDA_INT4_NORM", raising=False)
    kernels = quant.quant_kernels("awq")
    assert kernels.fused_norm is True
    x = residual = torch.zeros(1, 256, dtype=torch.bfloat16)
    norm_weight = torch.ones(256, dtype=torch.bfloat16)
    qweight = torch.zeros(32, 32, dtype=torch.int32)
    scales = zeros = torch.zeros(2, 32, dtype=torch.float16)
    operands = (qweight, scales, zeros, 128, None)
    # on the CPU the GEMV does not run: the norm kernel and the Triton/torch paths do
    assert kernels.int4_matmul_add_rms_norm(x, residual, norm_weight, 1e-6, *operands) is None
    assert quant.Int4Kernels().int4_matmul_add_rms_norm(x, residual, norm_weight, 1e-6,
                                                        *operands) is None
