"""The tensor-core int4 GEMV (``octavo_cuda.int4_mma``, CUDA C++ through NVRTC) against the
plain-torch reference on an NVIDIA GPU (skipped in CI: there is no GPU and no NVRTC there).

Shapes: small ones with every launch config, and Llama-3-8B's projections (group 128) for 1,
2, 3 and 8 rows in bfloat16 and float16; eagerly, replayed from a CUDA graph, and after the
RMS norm that writes ``x`` with programmatic dependent launch (the kernel reads its first
weights before it waits for the norm). The words in GPTQ's layout and in 32-output panels
(``to_panels``, what the backend loads) give bit-identical outputs (40 groups: some warps
have one, some none).
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
from octavo.kernels.int4 import int4_linear_reference, pack_rows, quantize_int4, to_panels

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or getattr(torch.version, "hip", None) is not None,
        reason="needs an NVIDIA GPU and a CUDA build of torch",
    ),
]

LLAMA3_8B = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]
@functools.cache
def configs():
    from octavo_cuda.int4_mma import CANDIDATES, MmaGemvConfig

    return [MmaGemvConfig(1, 1)] + CANDIDATES


# float32 sums in another order than the reference's, one rounding to the output dtype
RELATIVE_ERROR = {torch.bfloat16: 1e-2, torch.float16: 2e-3}


@functools.cache  # quantized once on the CPU for both dtypes
def int4_weight(n: int, k: int, group_size: int = 128, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(n, k, generator=gen) * 0.05
    values, scales, zeros = quantize_int4(weight, group_size, False, None)
    return pack_rows(values).cuda(), scales.half().cuda(), zeros.half().cuda()


def relative_error(out: torch.Tensor, expected: torch.Tensor) -> float:
    return ((out.float() - expected.float()).abs().max()
            / expected.float().abs().max().clamp(min=1e-6)).item()


@pytest.mark.parametrize("m", [1, 3, 8], ids=lambda m: f"m{m}")
@pytest.mark.parametrize("group_size", [32, 128])
def test_every_config_small_shapes(m, group_size):
    from octavo_cuda.int4_mma import int4_mma_gemv, supports

    # 40 groups: not a multiple of the warps (some warps get fewer, 16 warps leave two
    # without any), nor, per warp, always of the two groups a loop trip takes
    n, k = 128, 40 * group_size
    qweight, scales, zeros = int4_weight(n, k, group_size)
    x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
    assert supports(x, qweight, scales, zeros, group_size, None)
    expected = int4_linear_reference(x.float(), qweight, scales, zeros, group_size)
    panels = to_panels(qweight)
    assert supports(x, panels, scales, zeros, group_size, None)
    for config in configs():
        out = int4_mma_gemv(x, qweight, scales, zeros, group_size, config)
        assert out.shape == (m, n) and out.dtype == torch.bfloat16
        assert relative_error(out, expected) < RELATIVE_ERROR[torch.bfloat16], config
        assert torch.equal(int4_mma_gemv(x, panels, scales, zeros, group_size, config), out)


@pytest.mark.parametrize("n, k", LLAMA3_8B, ids=str)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_llama3_8b_shapes_rows_graphs_and_pdl(n, k, dtype):
    from octavo.kernels.triton.rmsnorm import rms_norm
    from octavo_cuda.int4_mma import MmaGemvConfig, _sms, default_config, int4_mma_gemv

    qweight, scales, zeros = int4_weight(n, k)
    panels = to_panels(qweight)
    for m in (1, 2, 3, 8):
        x = torch.randn(m, k, device="cuda").to(dtype)
        expected = int4_linear_reference(x.float(), qweight, scales, zeros, 128)
        for config in dict.fromkeys([default_config(n, k, _sms(0)), MmaGemvConfig(1, 8),
                                     MmaGemvConfig(2, 16), MmaGemvConfig(4, 8)]):
            out = int4_mma_gemv(x, qweight, scales, zeros, 128, config)
            assert relative_error(out, expected) < RELATIVE_ERROR[dtype], (m, config)
            assert torch.equal(int4_mma_gemv(x, panels, scales, zeros, 128, config), out)
    # after a norm (PDL), eagerly and from a graph, with x's storage rewritten in between
    x = torch.randn(1, k, device="cuda").to(dtype)
    norm_weight = torch.ones(k, device="cuda", dtype=dtype)
    expected = int4_linear_reference(rms_norm(x, norm_weight, 1e-6).float(), qweight, scales,
                                     zeros, 128)
    out = int4_mma_gemv(rms_norm(x, norm_weight, 1e-6), panels, scales, zeros, 128)
    assert relative_error(out, expected) < RELATIVE_ERROR[dtype]
    static_x = torch.zeros_like(x)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = int4_mma_gemv(rms_norm(static_x, norm_weight, 1e-6), panels, scales,
                                 zeros, 128)
    for _ in range(3):
        static_x.copy_(x)
        graph.replay()
        torch.cuda.synchronize()
        assert relative_error(captured, expected) < RELATIVE_ERROR[dtype]
        static_x.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert captured.float().abs().max().item() == 0.0
    # the next kernel launched once the sums are done, not at the wait: the same sums, and
    # the norm after it (PDL) reads them whole, eagerly and from a graph
    early = default_config(n, k, _sms(0))
    late = dataclasses.replace(early, early_trigger=False)
    h = rms_norm(x, norm_weight, 1e-6)
    assert torch.equal(int4_mma_gemv(h, panels, scales, zeros, 128, late),
                       int4_mma_gemv(h, panels, scales, zeros, 128, early))
    if n == k:  # o: its output is the next norm's input
        def chain(config):
            out = int4_mma_gemv(rms_norm(static_x, norm_weight, 1e-6), panels, scales, zeros,
                                128, config)
            return rms_norm(out, norm_weight, 1e-6)

        static_x.copy_(x)
        expected_chain = chain(early)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = chain(late)
        for _ in range(3):
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(captured, expected_chain)


@pytest.mark.parametrize("n, k", [(6144, 4096), (28672, 4096), (1024, 3200), (1024, 8192)],
                         ids=str)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_the_norm_in_the_gemv_equals_the_norm_then_the_gemv(n, k, dtype):
    """``int4_mma_gemv_add_rms_norm`` against ``fused_add_rms_norm`` then ``int4_mma_gemv``
    (qkv's and gate_up's shapes, a row that does not fill its threads' last vectors, the
    longest row; every config that takes them): the new residual bit for bit,
    the outputs within a rounding of the normed row (its sum of squares is summed in another
    order); eagerly and replayed from a graph after a norm (PDL)."""
    from octavo.kernels.triton.rmsnorm import fused_add_rms_norm, rms_norm
    from octavo_cuda.int4_mma import (
        int4_mma_gemv,
        int4_mma_gemv_add_rms_norm,
        norm_supported,
        supports,
    )

    qweight, scales, zeros = int4_weight(n, k)
    panels = to_panels(qweight)
    x = torch.randn(1, k, device="cuda").to(dtype)
    residual = torch.randn(1, k, device="cuda").to(dtype)
    norm_weight = (1 + 0.1 * torch.randn(k, device="cuda")).to(dtype)
    assert supports(x, panels, scales, zeros, 128, None)
    assert norm_supported(x, residual, norm_weight)
    h, expected_residual = fused_add_rms_norm(x, residual, norm_weight, 1e-6)
    for config in [c for c in configs() if n % (16 * c.vec) == 0]:
        expected = int4_mma_gemv(h, panels, scales, zeros, 128, config)
        out, new_residual = int4_mma_gemv_add_rms_norm(x, residual, norm_weight, 1e-6, panels,
                                                       scales, zeros, 128, config)
        assert torch.equal(new_residual, expected_residual), config
        assert relative_error(out, expected) < RELATIVE_ERROR[dtype], config
    # after a norm that writes x (PDL), from a graph, x's storage rewritten in between
    static_x = torch.zeros_like(x)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured, captured_residual = int4_mma_gemv_add_rms_norm(
            rms_norm(static_x, norm_weight, 1e-6), residual, norm_weight, 1e-6, panels,
            scales, zeros, 128)
    h, expected_residual = fused_add_rms_norm(rms_norm(x, norm_weight, 1e-6), residual,
                                              norm_weight, 1e-6)
    expected = int4_mma_gemv(h, panels, scales, zeros, 128)
    for _ in range(3):
        static_x.copy_(x)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured_residual, expected_residual)
        assert relative_error(captured, expected) < RELATIVE_ERROR[dtype]
        static_x.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured_residual, residual)  # 0 + residual
