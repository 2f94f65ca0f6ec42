"""Dense (unquantized) linear layers: ``x @ W^T + bias`` for the model-dtype weights.

``F.linear`` (cuBLAS on NVIDIA GPUs), except for one row (a batch-1 decode step) on NVIDIA
GPUs with programmatic dependent launch (compute capability 9.0+, ``octavo.kernels.triton.pdl``
on): there the Triton one-row GEMV (``octavo.kernels.triton.dense_gemv``) reads its weights
while the kernel before it still runs, and adds the bias in the same kernel. Inside a
decode-like chain on an H200 it took a 0.5B model's layer from 27.7 to 17.7 µs of GEMV time
and norms (docs/benchmarks.md, ``bench_dense_gemv.py``). Not on ROCm (not run there) nor on
GPUs without PDL (not measured); ``OCTAVO_DENSE_GEMV=0`` keeps ``F.linear`` everywhere.

Importable without Triton: the kernel module is imported on first use.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from octavo import envs
from octavo.kernels.triton_support import optional_triton_kernels

_ONE_ROW_DTYPES = (torch.bfloat16, torch.float16)


@functools.cache
def _one_row_kernel_on(device_index: int) -> bool:
    """Whether CUDA device ``device_index`` runs the one-row kernel (read once per process:
    layers ask on every call)."""
    if not envs.dense_gemv() or torch.version.hip is not None:
        return False
    pdl = optional_triton_kernels("pdl")
    if pdl is None or optional_triton_kernels("dense_gemv") is None:
        return False
    return pdl.pdl_launch(torch.device("cuda", device_index))["USE_PDL"]


def uses_one_row_kernel(x: torch.Tensor, weight: torch.Tensor,
                        bias: torch.Tensor | None) -> bool:
    """Whether ``dense_linear(x, weight, bias)`` runs the Triton one-row GEMV."""
    return (x.dim() == 2 and x.shape[0] == 1 and x.device.type == "cuda"
            and x.dtype in _ONE_ROW_DTYPES and weight.dtype == x.dtype
            and weight.stride(1) == 1 and (bias is None or bias.dtype == x.dtype)
            and _one_row_kernel_on(x.device.index if x.device.index is not None
                                   else torch.cuda.current_device()))


def dense_linear(x: torch.Tensor,  # [num_tokens, K] in the model dtype
                 weight: torch.Tensor,  # [N, K]
                 bias: torch.Tensor | None) -> torch.Tensor:  # [num_tokens, N]
    """``x @ weight^T + bias`` (module docstring for which kernel runs)."""
    if uses_one_row_kernel(x, weight, bias):
        return optional_triton_kernels("dense_gemv").dense_gemv(x, weight, bias)
    return F.linear(x, weight, bias)
