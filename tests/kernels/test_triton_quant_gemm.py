"""The dequantize-in-GEMM Triton kernels (int4 GPTQ/AWQ, GGUF blocks) against their torch
references (``int4_linear_reference``, ``gguf_matmul_reference``).

On the CPU they run under the Triton interpreter at small shapes and tiles; ``gpu`` tests take
Llama-3-8B's projection shapes with the default (H100) tiles. Decode shapes (one row) split K
over several programs, prefill shapes do not: both paths are covered.
"""

from __future__ import annotations

import pytest
import torch
from octavo.kernels.gguf import GGUF_BLOCKS, gguf_matmul_reference
from octavo.kernels.int4 import int4_linear_reference, pack_rows, quantize_int4, to_panels
from octavo.kernels.triton.gguf_gemm import gguf_gemm
from octavo.kernels.triton.int4_gemm import Int4GemmConfig, int4_gemm

from tests.kernels.conftest import DEVICE, TOLERANCES

SMALL = Int4GemmConfig(block_m=16, block_n=16, block_k=32, target_programs=8)
# K block scales of the GGUF types sit at these byte offsets (float16 d, and dmin/m).
_SCALE_AT = {"Q4_0": [0], "Q8_0": [0], "Q4_1": [0, 2], "Q4_K": [0, 2], "Q6_K": [208]}
_SCALE_SIZE = {"Q4_0": 0.02, "Q8_0": 0.02, "Q4_1": 0.02, "Q4_K": 3e-4, "Q6_K": 3e-5}


def int4_weight(n, k, group_size, sym, act_order, seed=0):
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(n, k, generator=gen) * 0.05
    g_idx = None
    if act_order:
        g_idx = torch.empty(k, dtype=torch.int32)
        g_idx[torch.randperm(k, generator=gen)] = torch.arange(k, dtype=torch.int32) // group_size
    values, scales, zeros = quantize_int4(weight, group_size, sym, g_idx)
    return pack_rows(values), scales, zeros.half(), g_idx


def gguf_weight(qtype, n, k, seed=0):
    """Random ``qtype`` blocks with small finite scales: uint8 ``[n, bytes per row]``."""
    gen = torch.Generator().manual_seed(seed)
    block_size, type_size = GGUF_BLOCKS[qtype]
    blocks = torch.randint(0, 256, (n * k // block_size, type_size), dtype=torch.uint8,
                           generator=gen)
    for offset in _SCALE_AT[qtype]:
        values = (torch.rand(blocks.shape[0], generator=gen) * _SCALE_SIZE[qtype]).half()
        blocks[:, offset:offset + 2] = values.view(torch.uint8).reshape(-1, 2)
    return blocks.reshape(n, -1)


def assert_close(out, expected, dtype):
    atol, rtol = TOLERANCES[dtype]
    scale = expected.float().abs().max().clamp(min=1.0)  # sums over K: relative to the output
    torch.testing.assert_close(out.float(), expected.float(), atol=atol * scale, rtol=rtol)


@pytest.mark.parametrize("m", [1, 19], ids=lambda m: f"m{m}")
@pytest.mark.parametrize("sym, act_order", [(True, False), (False, False), (False, True)],
                         ids=["sym", "asym", "asym-act-order"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_int4_gemm_matches_the_reference(m, sym, act_order, dtype):
    n, k, group_size = 48, 128, 32
    qweight, scales, zeros, g_idx = int4_weight(n, k, group_size, sym, act_order)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(1)).to(dtype)
    args = [t.to(DEVICE) if t is not None else None for t in (x, qweight, scales, zeros)]
    g = g_idx.to(DEVICE) if g_idx is not None else None
    out = int4_gemm(*args, group_size, g, config=SMALL)
    expected = int4_linear_reference(*args, group_size, g)
    assert out.shape == (m, n) and out.dtype == dtype
    assert_close(out, expected, dtype)


@pytest.mark.parametrize("act_order", [False, True], ids=["natural", "act-order"])
def test_int4_gemm_reads_panels_as_gptq_rows(act_order):
    """The same words in 32-output panels (``to_panels``) give the same output, bit for bit."""
    n, k, group_size = 64, 128, 32
    qweight, scales, zeros, g_idx = int4_weight(n, k, group_size, False, act_order)
    x = torch.randn(19, k, generator=torch.Generator().manual_seed(1))
    args = [t.to(DEVICE) for t in (x, qweight, scales, zeros)]
    g = g_idx.to(DEVICE) if g_idx is not None else None
    out = int4_gemm(*args, group_size, g, config=SMALL)
    panels = to_panels(args[1])
    assert torch.equal(int4_gemm(args[0], panels, *args[2:], group_size, g, config=SMALL), out)
    assert_close(out, int4_linear_reference(*args, group_size, g), torch.float32)


@pytest.mark.parametrize("qtype", list(GGUF_BLOCKS))
@pytest.mark.parametrize("m", [1, 17], ids=lambda m: f"m{m}")
def test_gguf_gemm_matches_the_reference(qtype, m):
    n, k = 24, 256
    blocks = gguf_weight(qtype, n, k).to(DEVICE)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    out = gguf_gemm(x, blocks, qtype, k, config=SMALL)
    expected = gguf_matmul_reference(x, blocks, qtype, k)
    assert out.shape == (m, n)
    assert_close(out, expected, torch.float32)


def test_gguf_gemm_refuses_blocks_of_another_width():
    blocks = gguf_weight("Q4_0", 4, 64)
    with pytest.raises(ValueError, match="do not describe a weight of 96 inputs"):
        gguf_gemm(torch.randn(1, 96), blocks, "Q4_0", 96)


# ---- full shapes on the GPU ----------------------------------------------------------------

# Llama-3-8B projections (N, K): qkv, o, gate_up, down.
LLAMA3_8B = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]


@pytest.mark.gpu
@pytest.mark.parametrize("n, k", LLAMA3_8B, ids=lambda v: str(v))
@pytest.mark.parametrize("m", [1, 256], ids=lambda m: f"m{m}")
def test_int4_gemm_llama3_8b_shapes_on_gpu(n, k, m):
    qweight, scales, zeros, _ = int4_weight(n, k, 128, sym=False, act_order=False)
    x = torch.randn(m, k).to(torch.bfloat16)
    args = [t.to("cuda") for t in (x, qweight, scales, zeros)]
    assert_close(int4_gemm(*args, 128), int4_linear_reference(*args, 128), torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("qtype", list(GGUF_BLOCKS))
@pytest.mark.parametrize("m", [1, 64], ids=lambda m: f"m{m}")
def test_gguf_gemm_llama3_8b_shape_on_gpu(qtype, m):
    n, k = 4096, 14336  # down_proj: 448 blocks of 32, 56 of 256
    blocks = gguf_weight(qtype, n, k).to("cuda")
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    assert_close(gguf_gemm(x, blocks, qtype, k), gguf_matmul_reference(x, blocks, qtype, k),
                 torch.bfloat16)
