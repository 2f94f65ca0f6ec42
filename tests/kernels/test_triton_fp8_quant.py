"""The one-kernel per-token fp8 quantization against ``octavo.kernels.fp8``'s torch ops: the
same e4m3 bytes and scales, bit for bit (CPU under the interpreter; full shapes on a GPU)."""

from __future__ import annotations

import pytest
import torch
from octavo.kernels.fp8 import _MIN_SCALE, INV_FP8_MAX, quantize_fp8_per_token
from octavo.kernels.triton.fp8_quant import quantize_fp8_per_token as triton_per_token

from tests.kernels.conftest import DEVICE


def _rows(m: int, k: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    # Rows of very different magnitudes, one all zero, one with values on e4m3 ties.
    x = torch.randn(m, k, generator=gen) * torch.logspace(-3, 3, m)[:, None]
    x[1] = 0.0
    x[2, : min(k, 8)] = torch.tensor([448.0, -448.0, 1.0, 17.0, -0.0, 3.0, 2.0 ** -9, 40.0])[
        : min(k, 8)]
    return x.to(dtype).to(DEVICE)


def _check(x: torch.Tensor) -> None:
    want_q, want_scale = quantize_fp8_per_token(x)
    got_q, got_scale = triton_per_token(x, INV_FP8_MAX, _MIN_SCALE)
    assert got_scale.shape == want_scale.shape and got_q.dtype == torch.float8_e4m3fn
    assert torch.equal(got_scale, want_scale)
    assert torch.equal(got_q.view(torch.uint8), want_q.view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m,k", [(5, 40), (3, 1300)])  # one block; several, the last partial
def test_bytes_and_scales_equal_the_torch_ops(dtype, m, k):
    _check(_rows(m, k, dtype))


def test_a_strided_view_and_no_rows():
    x = _rows(4, 96, torch.bfloat16)
    _check(x[:, :64])  # rows 96 apart
    q, scale = triton_per_token(x[:0], INV_FP8_MAX, _MIN_SCALE)
    assert q.shape == (0, 96) and scale.shape == (0, 1)


@pytest.mark.gpu
@pytest.mark.parametrize("k", [4096, 14336])
def test_llama8b_widths_on_gpu(k):
    _check(_rows(512, k, torch.bfloat16, seed=1))
