"""The GGUF matmul kernels (``octavo_cpu.quant``) against the torch reference.

Three layers of checks, for Q4_0, Q4_1, Q8_0, Q4_K and Q6_K:

1. the torch reference dequantizer (``octavo_cpu.quant_reference``, written from the block
   layouts) equals ``gguf.quants.dequantize``, the gguf package's own, bit for bit; the C++
   ``dequantize`` equals it too;
2. ``gguf_matmul`` equals the reference of its exact arithmetic (activations quantized to int8
   per 32 values, float64 sums) up to float32 summation, for decode (1 row), small batches and
   prefill-sized blocks of rows (every register-tile remainder), float32 and bfloat16, with 1
   and 2 threads, on every instruction set this CPU runs (AVX2 here; AVX-512 VNNI where the CPU
   has it);
3. against the plain float product ``x @ dequantize(W).T`` it stays within the int8 error of
   the activations.

Weights are random bytes with sane scales: every bit pattern of a block is a valid weight.
"""

from __future__ import annotations

import platform
import sys

import gguf
import numpy as np
import pytest
import torch
from cpu_info import cpu_flags
from octavo_cpu import quant
from octavo_cpu import quant_reference as ref
from octavo_cpu.kernels import load_kernels

QTYPES = ref.QTYPES


_QUANT_ISA_FLAGS = {
    "avx2": {"avx2", "fma", "f16c"},
    "avx512vnni": {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni"},
}
# Only what this CPU runs: a machine without AVX-512 VNNI runs fewer cases, none skipped.
CPU_QUANT_ISAS = [isa for isa, needed in _QUANT_ISA_FLAGS.items() if needed <= cpu_flags()]


@pytest.fixture(scope="module")
def kernels():
    kernels = load_kernels()
    if kernels is None:
        if sys.platform.startswith("linux") and platform.machine() in ("x86_64", "AMD64"):
            pytest.fail("the C++ kernels did not build on x86-64 Linux (see the warning above)")
        pytest.skip(f"no C++ kernels on {sys.platform}/{platform.machine()}")
    return kernels


def make_blocks(qtype: str, rows: int, in_features: int, seed: int = 0) -> torch.Tensor:
    """Random GGUF blocks ``[rows, bytes_per_row]`` whose values are about N(0, 0.1)-sized."""
    gen = torch.Generator().manual_seed(seed)
    elems, nbytes = ref.BLOCK_LAYOUTS[qtype]
    num_blocks = in_features // elems
    blocks = torch.randint(0, 256, (rows, num_blocks, nbytes), dtype=torch.uint8, generator=gen)

    def put_f16(offset: int, values: torch.Tensor) -> None:
        blocks[:, :, offset:offset + 2] = (
            values.to(torch.float16).view(torch.uint8).reshape(rows, num_blocks, 2))

    def uniform(low: float, high: float) -> torch.Tensor:
        return low + (high - low) * torch.rand(rows, num_blocks, generator=gen)

    if qtype == "Q4_0":
        put_f16(0, uniform(0.005, 0.03))
    elif qtype == "Q4_1":
        put_f16(0, uniform(0.005, 0.02))
        put_f16(2, uniform(-0.15, 0.0))
    elif qtype == "Q8_0":
        put_f16(0, uniform(0.0005, 0.002))
    elif qtype == "Q4_K":
        put_f16(0, uniform(0.0002, 0.0006))  # d x 6-bit scale x 4-bit q: up to ~0.5
        put_f16(2, uniform(0.0002, 0.0006))
    elif qtype == "Q6_K":
        put_f16(208, uniform(0.00005, 0.0001))  # d x int8 scale x (q - 32)
    return blocks.reshape(rows, num_blocks * nbytes)


def in_features_for(qtype: str) -> int:
    return 512 if qtype in ("Q4_K", "Q6_K") else 96


# ---- 1. dequantizers ----------------------------------------------------------------------


@pytest.mark.parametrize("qtype", QTYPES)
def test_reference_dequantizer_equals_the_gguf_package(qtype: str) -> None:
    in_features = in_features_for(qtype) * 2
    blocks = make_blocks(qtype, 7, in_features, seed=1)
    expected = gguf.quants.dequantize(blocks.numpy(), gguf.GGMLQuantizationType[qtype])
    ours = ref.dequantize(blocks, qtype, in_features)
    assert ours.dtype == torch.float32 and ours.shape == (7, in_features)
    assert torch.isfinite(ours).all()
    assert torch.equal(ours, torch.from_numpy(np.ascontiguousarray(expected, np.float32)))


@pytest.mark.parametrize("qtype", QTYPES)
def test_cpp_dequantize_equals_the_reference(kernels, qtype: str) -> None:
    in_features = in_features_for(qtype)
    blocks = make_blocks(qtype, 33, in_features, seed=2)
    assert torch.equal(quant.dequantize(blocks, qtype, in_features),
                       ref.dequantize(blocks, qtype, in_features))
    # A row subset (the embedding's lookups) with a stride between rows.
    rows = blocks[::3]
    assert torch.equal(quant.dequantize(rows, qtype, in_features),
                       ref.dequantize(rows, qtype, in_features))


def test_gguf_quantize_round_trip_through_the_kernels(kernels) -> None:
    """Blocks written by the gguf package's own quantizer (what a converter writes) decode to
    what that package decodes."""
    weight = np.random.default_rng(3).standard_normal((40, 128)).astype(np.float32) * 0.05
    for qtype in ("Q4_0", "Q4_1", "Q8_0"):
        gtype = gguf.GGMLQuantizationType[qtype]
        blocks = torch.from_numpy(np.ascontiguousarray(gguf.quants.quantize(weight, gtype)))
        expected = torch.from_numpy(gguf.quants.dequantize(blocks.numpy(), gtype))
        assert torch.equal(quant.dequantize(blocks, qtype, 128), expected), qtype


# ---- 2. the matmul against its exact arithmetic --------------------------------------------

# (rows, out_features): decode with a column remainder, the 4-row tiles with every row
# remainder, and more than one 64-row block with a remainder of both.
SHAPES = [(1, 13), (2, 9), (3, 8), (4, 7), (5, 16), (67, 11)]


def _tolerance(x: torch.Tensor, blocks: torch.Tensor, qtype: str, in_features: int) -> float:
    """float32 summation error bound: ~1e-6 of the sum of |terms| of the largest output."""
    magnitude = ref.quantize_activations(x).abs() @ ref.dequantize(blocks, qtype, in_features).abs().T
    return 2e-6 * float(magnitude.max()) + 1e-7


@pytest.mark.parametrize("isa", CPU_QUANT_ISAS)
@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("rows,out_features", SHAPES)
def test_gguf_matmul_float32_matches_its_reference(kernels, isa, qtype, rows, out_features):
    in_features = in_features_for(qtype)
    blocks = make_blocks(qtype, out_features, in_features, seed=rows)
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(out_features))
    y = quant.gguf_matmul(x, blocks, qtype, in_features, isa=isa)
    assert y.dtype == torch.float32 and y.shape == (rows, out_features)
    expected = ref.gguf_matmul_reference(x, blocks, qtype, in_features)
    atol = _tolerance(x, blocks, qtype, in_features)
    torch.testing.assert_close(y, expected, rtol=0, atol=atol)


@pytest.mark.parametrize("isa", CPU_QUANT_ISAS)
@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("rows", [1, 6])
def test_gguf_matmul_bfloat16(kernels, isa, qtype, rows):
    in_features = in_features_for(qtype)
    blocks = make_blocks(qtype, 10, in_features, seed=5)
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(6)).bfloat16()
    y = quant.gguf_matmul(x, blocks, qtype, in_features, isa=isa)
    assert y.dtype == torch.bfloat16 and y.shape == (rows, 10)
    expected = ref.gguf_matmul_reference(x.float(), blocks, qtype, in_features)
    # The float32 result rounded once to bfloat16 (8 bits of mantissa).
    torch.testing.assert_close(y.float(), expected, rtol=2**-8, atol=_tolerance(
        x.float(), blocks, qtype, in_features))


@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0", "Q4_K"])
def test_one_and_two_threads_give_the_same_result(kernels, qtype):
    in_features = in_features_for(qtype)
    blocks = make_blocks(qtype, 150, in_features, seed=7)
    x = torch.randn(70, in_features, generator=torch.Generator().manual_seed(8))
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = [quant.gguf_matmul(x[:rows], blocks, qtype, in_features) for rows in (1, 70)]
        torch.set_num_threads(2)
        two = [quant.gguf_matmul(x[:rows], blocks, qtype, in_features) for rows in (1, 70)]
    finally:
        torch.set_num_threads(previous)
    for a, b in zip(one, two):
        assert torch.equal(a, b)  # each output is summed by one thread, in one order


def test_model_sized_shapes(kernels):
    """The default model's shapes: decode and a prefill chunk through a 576 -> 1536 Q4_1 layer
    and the 576 -> 49152-row Q8_0 LM head's first rows."""
    for qtype, out_features, in_features, rows in (("Q4_1", 1536, 576, 1), ("Q4_1", 1536, 576, 130),
                                                   ("Q4_1", 576, 1536, 37), ("Q8_0", 1000, 576, 3)):
        blocks = make_blocks(qtype, out_features, in_features, seed=out_features)
        x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(rows))
        y = quant.gguf_matmul(x, blocks, qtype, in_features)
        expected = ref.gguf_matmul_reference(x, blocks, qtype, in_features)
        torch.testing.assert_close(y, expected, rtol=0,
                                   atol=_tolerance(x, blocks, qtype, in_features))


def test_strided_inputs_and_empty_batches(kernels):
    blocks = make_blocks("Q4_1", 24, 64, seed=9)
    x = torch.randn(5, 128)[:, ::2]  # last dim not contiguous
    torch.testing.assert_close(quant.gguf_matmul(x, blocks, "Q4_1", 64),
                               ref.gguf_matmul_reference(x, blocks, "Q4_1", 64), rtol=0,
                               atol=_tolerance(x, blocks, "Q4_1", 64))
    every_other_row = blocks[::2]  # rows of blocks with a stride between them
    torch.testing.assert_close(quant.gguf_matmul(x, every_other_row, "Q4_1", 64),
                               ref.gguf_matmul_reference(x, every_other_row, "Q4_1", 64),
                               rtol=0, atol=_tolerance(x, every_other_row, "Q4_1", 64))
    assert quant.gguf_matmul(torch.zeros(0, 64), blocks, "Q4_1", 64).shape == (0, 24)
    zeros = quant.gguf_matmul(torch.zeros(2, 64), blocks, "Q4_1", 64)
    assert torch.equal(zeros, torch.zeros(2, 24))  # all-zero chunks: scale 0, no NaN


# ---- 3. against the float product ------------------------------------------------------------


@pytest.mark.parametrize("qtype", QTYPES)
def test_gguf_matmul_is_within_the_int8_activation_error(kernels, qtype):
    in_features = in_features_for(qtype) * 2
    blocks = make_blocks(qtype, 64, in_features, seed=11)
    x = torch.randn(16, in_features, generator=torch.Generator().manual_seed(12))
    y = quant.gguf_matmul(x, blocks, qtype, in_features)
    exact = x @ ref.dequantize(blocks, qtype, in_features).T
    # Each activation moves by at most half a step (max|x| / 254 of its chunk): for Gaussian
    # inputs that is about 0.5 % of the output's norm.
    relative = float((y - exact).norm() / exact.norm())
    assert relative < 0.015, relative


# ---- errors, fallback, coverage -----------------------------------------------------------


def test_bad_inputs_are_named():
    blocks = make_blocks("Q4_0", 4, 64)
    x = torch.randn(2, 64)
    with pytest.raises(ValueError, match="not supported.*Q4_0, Q4_1, Q8_0, Q4_K, Q6_K"):
        quant.gguf_matmul(x, blocks, "Q5_K", 64)
    with pytest.raises(ValueError, match="takes 36 bytes"):
        quant.gguf_matmul(x, blocks[:, :18], "Q4_0", 64)
    with pytest.raises(ValueError, match="multiple of Q4_K's block of 256"):
        quant.gguf_matmul(x, blocks, "Q4_K", 64)
    with pytest.raises(ValueError, match="x has 32 features"):
        quant.gguf_matmul(torch.randn(2, 32), blocks, "Q4_0", 64)
    with pytest.raises(TypeError, match="float32 or bfloat16"):
        quant.gguf_matmul(x.half(), blocks, "Q4_0", 64)
    with pytest.raises(TypeError, match="uint8 tensor"):
        quant.gguf_matmul(x, blocks.to(torch.int8), "Q4_0", 64)


def test_without_the_kernels_the_torch_reference_runs(monkeypatch):
    blocks = make_blocks("Q6_K", 5, 256)
    x = torch.randn(3, 256)
    monkeypatch.setattr(quant, "_kernels", lambda: None)
    assert not quant.kernels_available()
    assert quant.quant_kernels("gguf") is None  # the gguf method's torch path runs
    exact = x @ ref.dequantize(blocks, "Q6_K", 256).T
    torch.testing.assert_close(quant.gguf_matmul(x, blocks, "Q6_K", 256), exact)
    assert torch.equal(quant.dequantize(blocks, "Q6_K", 256), ref.dequantize(blocks, "Q6_K", 256))


def test_the_default_model_uses_only_covered_types():
    """Every 2-D tensor of SmolLM2-135M-Instruct (Q4_1 linears, a Q8_0 tied embedding) is in a
    type the kernels take, so none of it is dequantized."""
    from octavo.model_executor.loader.default_model import (
        DEFAULT_MODEL_INSTALL_HINT,
        find_default_model,
    )
    from octavo.model_executor.loader.gguf_file import read_gguf

    path = find_default_model()
    if path is None:
        pytest.skip(f"the default model is not installed ({DEFAULT_MODEL_INSTALL_HINT})")
    types = {t.qtype.name for t in read_gguf(path).tensors if len(t.shape) == 2}
    assert types == {"Q4_1", "Q8_0"}
    assert types <= set(QTYPES)


def test_the_backend_gives_the_gguf_method_its_kernels(monkeypatch):
    """``octavo_quant_kernels`` on the CPU backend: the C++ ops for ``gguf`` (nothing for the
    other methods, nothing with ``OCTAVO_CPU_GGUF_KERNELS=0``); inputs the ops do not take
    (float16, 3-D) are answered too."""
    from octavo.plugins import get_plugin_manager

    pm = get_plugin_manager()
    assert pm.hook.octavo_quant_kernels(backend="cpu", method="fp8") is None
    monkeypatch.setenv("OCTAVO_CPU_GGUF_KERNELS", "0")
    assert pm.hook.octavo_quant_kernels(backend="cpu", method="gguf") is None
    monkeypatch.setenv("OCTAVO_CPU_GGUF_KERNELS", "1")
    if not quant.kernels_available():
        pytest.fail("the C++ GGUF kernels did not build on this machine (see the warning)")
    kernels = pm.hook.octavo_quant_kernels(backend="cpu", method="gguf")
    assert isinstance(kernels, quant.GGUFQuantKernels)
    blocks = make_blocks("Q4_0", 6, 64)
    exact = ref.dequantize(blocks, "Q4_0", 64)
    x = torch.randn(2, 3, 64)
    torch.testing.assert_close(kernels.gguf_matmul(x, blocks, "Q4_0", 64), x @ exact.T,
                               rtol=0.05, atol=0.05)
    half = kernels.gguf_matmul(x[0].half(), blocks, "Q4_0", 64)
    assert half.dtype == torch.float16
    torch.testing.assert_close(half.float(), x[0] @ exact.T, rtol=1e-2, atol=1e-2)
    assert torch.equal(kernels.gguf_dequantize(blocks, "Q4_0", 64), exact)
