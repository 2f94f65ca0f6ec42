"""FP8 (e4m3) weights: quantizing, dequantizing and the matmul.

Formats (what ``octavo.model_executor.layers.quantization.fp8`` stores):

- weights ``[N, K]`` in ``torch.float8_e4m3fn`` with a float32 scale per output channel
  ``[N]`` (a checkpoint's per-tensor scale is spread over its channels), or per
  ``[block_n, block_k]`` block ``[ceil(N / block_n), ceil(K / block_k)]``; ``W = W_fp8 * scale``;
- activations quantized on the fly per token (``[M, 1]`` scales), or with one static scale
  from the checkpoint.

``fp8_linear`` picks, on a device with FP8 tensor cores (CUDA compute capability 8.9+,
Hopper/Ada) and per-channel scales:

- at most ``SMALL_M_MAX`` rows (decode; ``octavo.kernels.skinny``): the Triton w8a16 skinny
  kernel (``octavo.kernels.triton.fp8_gemv``): activations unquantized, the e4m3 weight read
  once and upcast in registers (the step is a weight read; quantizing the activations and a
  tensor-core GEMM only add kernels);
- more rows: ``torch._scaled_mm``, quantizing the activations (per token, in one Triton
  kernel, ``octavo.kernels.triton.fp8_quant``; or with the checkpoint's static scale).

Elsewhere (the CPU, older GPUs, ROCm, block scales) it dequantizes the weight to the
activations' dtype and runs a plain matmul, leaving the activations unquantized.
``fp8_linear_reference`` is these paths in plain torch, for tests.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from octavo.kernels.skinny import use_small_m_kernel
from octavo.kernels.triton_support import optional_triton_kernels

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
# 1 / 448 as a float32 (what a float32 product with it uses on every device).
INV_FP8_MAX = float(torch.tensor(1.0 / FP8_MAX, dtype=torch.float32))
# Smallest scale: keeps an all-zero row from dividing by zero.
_MIN_SCALE = 1.0 / (FP8_MAX * 512.0)


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``clamp(x / scale)`` in e4m3 (``scale`` broadcasts against ``x``), in float32 math."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def quantize_fp8_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[N, K]`` -> (e4m3 ``[N, K]``, float32 scales ``[N]``): each row's max maps to 448."""
    scale = (weight.abs().amax(dim=1).float() / FP8_MAX).clamp(min=_MIN_SCALE)  # [N]
    return quantize_fp8(weight, scale[:, None]), scale


def quantize_fp8_per_tensor(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[N, K]`` -> (e4m3 ``[N, K]``, a float32 scalar scale)."""
    scale = (weight.abs().amax().float() / FP8_MAX).clamp(min=_MIN_SCALE)
    return quantize_fp8(weight, scale), scale


def quantize_fp8_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic activation quantization: ``[M, K]`` -> (e4m3 ``[M, K]``, float32 ``[M, 1]``).

    The scale is ``amax`` times the float32 ``1 / 448``: a product is rounded the same way on
    every device (torch divides by a scalar as a multiplication by its reciprocal on CUDA but
    not on the CPU), and the Triton kernel (``octavo.kernels.triton.fp8_quant``) matches it
    bit for bit."""
    scale = (x.abs().amax(dim=1, keepdim=True).float() * INV_FP8_MAX).clamp(min=_MIN_SCALE)
    return quantize_fp8(x, scale), scale


def quantize_fp8_block(weight: torch.Tensor, block: tuple[int, int]
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """``[N, K]`` -> (e4m3 ``[N, K]``, float32 ``[ceil(N/bn), ceil(K/bk)]``): one scale per
    ``block`` tile (the FineGrainedFP8 / DeepSeek layout)."""
    n, k = weight.shape
    bn, bk = block
    padded = F.pad(weight.float(), (0, -k % bk, 0, -n % bn))
    tiles = padded.reshape(padded.shape[0] // bn, bn, padded.shape[1] // bk, bk)
    scale = (tiles.abs().amax(dim=(1, 3)) / FP8_MAX).clamp(min=_MIN_SCALE)  # [N/bn, K/bk]
    return quantize_fp8(weight, expand_block_scale(scale, block, (n, k))), scale


def expand_block_scale(scale: torch.Tensor, block: tuple[int, int],
                       shape: tuple[int, int]) -> torch.Tensor:
    """Block scales ``[ceil(N/bn), ceil(K/bk)]`` -> one per element ``[N, K]``."""
    n, k = shape
    return scale.repeat_interleave(block[0], 0)[:n].repeat_interleave(block[1], 1)[:, :k]


def dequantize_fp8(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype,
                   block: tuple[int, int] | None = None) -> torch.Tensor:
    """The dense ``[N, K]`` weight in ``dtype``: per-channel ``scale`` ``[N]`` (or a scalar),
    or block scales with ``block``."""
    if block is not None:
        return (weight.float() * expand_block_scale(scale, block, tuple(weight.shape))).to(dtype)
    if scale.dim() == 1:
        scale = scale[:, None]
    return (weight.float() * scale).to(dtype)


@functools.cache
def _scaled_mm_on(device_index: int) -> bool:
    if getattr(torch.version, "hip", None) or not hasattr(torch, "_scaled_mm"):
        return False  # ROCm's fp8 format is e4m3fnuz: not these weights
    return torch.cuda.get_device_capability(device_index) >= (8, 9)


def scaled_mm_supported(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``torch._scaled_mm`` runs ``x @ weight^T`` here: a CUDA device with FP8 tensor
    cores, and K and N multiples of 16 (the kernels' alignment)."""
    if x.device.type != "cuda" or weight.dtype != FP8_DTYPE:
        return False
    n, k = weight.shape
    return k % 16 == 0 and n % 16 == 0 and _scaled_mm_on(x.device.index or 0)


def fp8_linear(
    x: torch.Tensor,  # [M, K] float
    weight: torch.Tensor,  # [N, K] e4m3
    weight_scale: torch.Tensor,  # [N] float32 (per channel) or block scales
    bias: torch.Tensor | None,  # [N] or None
    input_scale: torch.Tensor | None = None,  # static per-tensor activation scale, or None
    block: tuple[int, int] | None = None,
) -> torch.Tensor:  # [M, N] in x's dtype
    """``x @ W^T + bias`` with FP8 weights: the w8a16 skinny kernel for a few rows, FP8
    tensor cores for more, where the GPU has them; else the dequantized weight (see the
    module docstring)."""
    if block is None and scaled_mm_supported(x, weight) and use_small_m_kernel(x.shape[0]):
        kernels = optional_triton_kernels("fp8_gemv")
        if kernels is not None:
            out = kernels.fp8_gemv(x, weight, weight_scale)
            return out if bias is None else out + bias
    if block is None and scaled_mm_supported(x, weight):
        if input_scale is None:
            quant = optional_triton_kernels("fp8_quant")
            if quant is not None:  # one kernel instead of ~11 passes of torch ops
                x_fp8, x_scale = quant.quantize_fp8_per_token(x, INV_FP8_MAX, _MIN_SCALE)
            else:
                x_fp8, x_scale = quantize_fp8_per_token(x)
        else:
            x_fp8 = quantize_fp8(x, input_scale)
            x_scale = input_scale.reshape(1, 1).expand(x.shape[0], 1).contiguous()
        out = torch._scaled_mm(x_fp8, weight.t(), scale_a=x_scale,
                               scale_b=weight_scale.reshape(1, -1), out_dtype=torch.bfloat16)
        out = out.to(x.dtype)
        return out if bias is None else out + bias
    return F.linear(x, dequantize_fp8(weight, weight_scale, x.dtype, block), bias)


def fp8_linear_reference(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
    bias: torch.Tensor | None, input_scale: torch.Tensor | None = None,
    block: tuple[int, int] | None = None, quantize_input: bool = False,
) -> torch.Tensor:
    """Plain-torch float32 reference of ``fp8_linear``; ``quantize_input`` also rounds the
    activations to e4m3 as the tensor-core path does."""
    xf = x.float()
    if quantize_input:
        if input_scale is None:
            x_fp8, x_scale = quantize_fp8_per_token(x)
        else:
            x_fp8, x_scale = quantize_fp8(x, input_scale), input_scale
        xf = x_fp8.float() * x_scale
    out = xf @ dequantize_fp8(weight, weight_scale, torch.float32, block).t()
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)
