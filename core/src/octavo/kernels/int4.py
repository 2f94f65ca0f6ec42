"""4-bit weight-only quantization (GPTQ and AWQ): the exact packings, and the matmul.

Both formats store, for a linear layer with ``K`` inputs and ``N`` outputs, 4-bit integers
``q`` in ``[0, 15]``, and per group of ``group_size`` inputs a scale and a zero point:
``W[n, k] = (q[k, n] - zero[g(k), n]) * scale[g(k), n]``. They differ in how they pack:

- **GPTQ** (AutoGPTQ, GPTQModel): ``qweight`` int32 ``[K / 8, N]`` packs eight consecutive
  *inputs* per int32, input ``8i + j`` in bits ``4j .. 4j + 3`` of row ``i``; ``qzeros`` int32
  ``[G, N / 8]`` packs eight consecutive *outputs* the same way; ``scales`` ``[G, N]``;
  ``g_idx`` int32 ``[K]`` gives each input's group (act-order / ``desc_act`` checkpoints permute
  it; otherwise ``k // group_size``). The original (``checkpoint_format: "gptq"``, v1) format
  stores ``zero - 1``; ``"gptq_v2"`` stores the zero itself.
- **AWQ** (AutoAWQ's GEMM format): ``qweight`` int32 ``[K, N / 8]`` packs eight *outputs* per
  int32 in an interleaved order: output ``8m + c`` sits in nibble ``AWQ_REVERSE_ORDER[c]``
  (nibble ``i`` holds output ``8m + AWQ_ORDER[i]``); ``qzeros`` ``[G, N / 8]`` the same;
  ``scales`` ``[G, N]``; groups are always ``k // group_size``.

What the matmul reads (``int4_linear``): GPTQ's ``qweight`` layout ``[K / 8, N]`` (AWQ weights
are repacked to it once, at load), or the same words in 32-output panels ``[N / 32, K / 8, 32]``
(``to_panels``: a backend may ask for them at load, ``int4_prepare_qweight``; every kernel here
reads both), ``scales`` and unpacked ``zeros`` ``[G, N]`` as float16, and ``g_idx`` only for
act-order weights. A backend may take calls first (``int4_linear``'s
``kernels``, from ``octavo_quant_kernels``: the CUDA backend's tensor-core GEMV for 1 to 8
rows). On GPUs, up to ``SMALL_M_MAX`` rows (decode; see ``octavo.kernels.skinny``) run the
skinny kernel (``octavo.kernels.triton.int4_gemv``: each packed word read once, group scales
applied once per group), more rows the tile kernel (``octavo.kernels.triton.int4_gemm``: tiles
dequantized inside the GEMM);
``int4_linear_reference`` unpacks to a dense weight and multiplies, in plain torch (the CPU
path and the tests' reference).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from octavo.kernels.skinny import use_small_m_kernel
from octavo.kernels.triton_support import optional_triton_kernels

PACK = 8  # 4-bit values per int32
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)
_SHIFTS = tuple(range(0, 32, 4))


def _shifts(device: torch.device) -> torch.Tensor:
    return torch.tensor(_SHIFTS, dtype=torch.int32, device=device)


def _to_int32(packed: torch.Tensor) -> torch.Tensor:
    """int64 bit patterns < 2**32 -> the int32 with the same 32 bits."""
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


# ---- GPTQ ---------------------------------------------------------------------------------------


def unpack_rows(packed: torch.Tensor) -> torch.Tensor:
    """int32 ``[R, C]`` packed along rows -> int32 values ``[8R, C]`` (row ``8i + j`` from the
    nibble ``j`` of row ``i``): GPTQ's ``qweight``."""
    values = (packed[:, None, :] >> _shifts(packed.device)[None, :, None]) & 0xF  # [R, 8, C]
    return values.reshape(-1, packed.shape[1])


def pack_rows(values: torch.Tensor) -> torch.Tensor:
    """Inverse of ``unpack_rows``: int values in [0, 15] ``[8R, C]`` -> int32 ``[R, C]``."""
    grouped = values.to(torch.int64).reshape(-1, PACK, values.shape[1])  # [R, 8, C]
    packed = (grouped << _shifts(values.device).to(torch.int64)[None, :, None]).sum(dim=1)
    return _to_int32(packed)


def unpack_cols(packed: torch.Tensor) -> torch.Tensor:
    """int32 ``[R, C]`` packed along columns -> ``[R, 8C]`` (column ``8m + j`` from nibble
    ``j``): GPTQ's ``qzeros``."""
    values = (packed[:, :, None] >> _shifts(packed.device)[None, None, :]) & 0xF  # [R, C, 8]
    return values.reshape(packed.shape[0], -1)


def pack_cols(values: torch.Tensor) -> torch.Tensor:
    """Inverse of ``unpack_cols``."""
    grouped = values.to(torch.int64).reshape(values.shape[0], -1, PACK)  # [R, C, 8]
    packed = (grouped << _shifts(values.device).to(torch.int64)[None, None, :]).sum(dim=2)
    return _to_int32(packed)


# ---- AWQ ----------------------------------------------------------------------------------------


def unpack_awq(packed: torch.Tensor) -> torch.Tensor:
    """AWQ int32 ``[R, C]`` (eight outputs per int32, interleaved) -> values ``[R, 8C]`` in
    output order."""
    nibbles = unpack_cols(packed).reshape(packed.shape[0], -1, PACK)  # [R, C, 8] nibble order
    order = torch.tensor(AWQ_REVERSE_ORDER, device=packed.device)
    return nibbles[:, :, order].reshape(packed.shape[0], -1)


def pack_awq(values: torch.Tensor) -> torch.Tensor:
    """Inverse of ``unpack_awq``: values ``[R, 8C]`` in output order -> AWQ int32 ``[R, C]``."""
    grouped = values.reshape(values.shape[0], -1, PACK)
    order = torch.tensor(AWQ_ORDER, device=values.device)
    return pack_cols(grouped[:, :, order].reshape(values.shape[0], -1))


# ---- 32-output panels ---------------------------------------------------------------------------

#: Outputs per panel of the panel layout (``to_panels``).
PANEL = 32


def to_panels(qweight: torch.Tensor) -> torch.Tensor:
    """GPTQ words ``[K / 8, N]`` -> the same words in panels of ``PANEL`` outputs, int32
    ``[N / PANEL, K / 8, PANEL]`` (``N`` a multiple of ``PANEL``): word ``(r, n)`` at
    ``[n // PANEL, r, n % PANEL]``. A GEMV block of 32 outputs then reads each group's words as
    one contiguous run instead of 128 bytes from each of 16 rows ``4N`` bytes apart."""
    rows, n = qweight.shape
    if n % PANEL or qweight.numel() >= 2**31:
        raise ValueError(f"to_panels: {n} outputs are not a multiple of {PANEL}, or "
                         f"{qweight.numel()} words are 2^31 or more (kernels index panels "
                         "with int32)")
    return qweight.view(rows, n // PANEL, PANEL).permute(1, 0, 2).contiguous()


def from_panels(panels: torch.Tensor) -> torch.Tensor:
    """Inverse of ``to_panels``."""
    count, rows, width = panels.shape
    return panels.permute(1, 0, 2).reshape(rows, count * width)


def is_panels(qweight: torch.Tensor) -> bool:
    """Whether ``qweight`` is in the panel layout (3-D) rather than GPTQ's ``[K / 8, N]``."""
    return qweight.dim() == 3


def word_shape(qweight: torch.Tensor) -> tuple[int, int]:
    """``(K / 8, N)`` of ``qweight`` in either layout."""
    if is_panels(qweight):
        return qweight.shape[1], qweight.shape[0] * qweight.shape[2]
    return qweight.shape[0], qweight.shape[1]


def gptq_words(qweight: torch.Tensor) -> torch.Tensor:
    """``qweight`` in GPTQ's ``[K / 8, N]`` layout (a copy when it is in panels)."""
    return from_panels(qweight) if is_panels(qweight) else qweight


# ---- dequantize and multiply ----------------------------------------------------------------


def group_index(num_inputs: int, group_size: int, g_idx: torch.Tensor | None,
                device: torch.device) -> torch.Tensor:
    """Each input's group: ``g_idx`` when given, else ``k // group_size``."""
    if g_idx is not None:
        return g_idx.long()
    return torch.arange(num_inputs, device=device) // group_size


def dequantize_int4(
    qweight: torch.Tensor,  # int32 [K / 8, N], GPTQ packing (or panels: to_panels)
    scales: torch.Tensor,  # [G, N]
    zeros: torch.Tensor,  # [G, N] zero points (unpacked)
    group_size: int,
    g_idx: torch.Tensor | None = None,  # int32 [K]
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:  # [N, K]
    """The dense weight ``[N, K]`` in ``dtype`` (float32 math)."""
    q = unpack_rows(gptq_words(qweight)).float()  # [K, N]
    groups = group_index(q.shape[0], group_size, g_idx, q.device)
    weight = (q - zeros.float()[groups]) * scales.float()[groups]  # [K, N]
    return weight.t().to(dtype)


def int4_linear_reference(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
    group_size: int, g_idx: torch.Tensor | None = None, bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x @ W^T + bias`` with ``W`` unpacked to ``x``'s dtype: the plain-torch path."""
    return F.linear(x, dequantize_int4(qweight, scales, zeros, group_size, g_idx, x.dtype), bias)


def int4_linear(
    x: torch.Tensor,  # [M, K]
    qweight: torch.Tensor,  # int32 [K / 8, N], or panels [N / 32, K / 8, 32] (to_panels)
    scales: torch.Tensor,  # float16 [G, N]
    zeros: torch.Tensor,  # float16 [G, N]
    group_size: int,
    g_idx: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    kernels: Any = None,  # a backend's kernels for the method (octavo_quant_kernels)
) -> torch.Tensor:  # [M, N] in x's dtype
    """The backend's ``kernels.int4_matmul(x, qweight, scales, zeros, group_size, g_idx)`` when
    it has one and takes the call (it returns ``None`` for calls it leaves to the others);
    else on GPUs the Triton skinny kernel for at most ``SMALL_M_MAX`` rows, the
    dequantize-in-GEMM tile kernel for more; the dequantized matmul elsewhere."""
    backend_kernel = getattr(kernels, "int4_matmul", None)
    if backend_kernel is not None:
        out = backend_kernel(x, qweight, scales, zeros, group_size, g_idx)
        if out is not None:
            return out if bias is None else out + bias
    if x.device.type == "cuda":
        small = use_small_m_kernel(x.shape[0])
        triton_kernels = optional_triton_kernels("int4_gemv" if small else "int4_gemm")
        if triton_kernels is not None:
            if small:
                out = triton_kernels.int4_gemv(x, qweight, scales, zeros, group_size, g_idx)
            else:
                out = triton_kernels.int4_gemm(x, qweight, scales, zeros, group_size, g_idx)
            return out if bias is None else out + bias
    return int4_linear_reference(x, qweight, scales, zeros, group_size, g_idx, bias)


# ---- quantizing (checkpoint makers and tests) -----------------------------------------------


def quantize_int4(
    weight: torch.Tensor,  # [N, K] float
    group_size: int,
    symmetric: bool,
    g_idx: torch.Tensor | None = None,  # [K] group of each input (act-order), or None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round-to-nearest 4-bit quantization by groups of inputs, as GPTQ/AWQ lay it out:
    (values ``[K, N]`` int32 in [0, 15], scales ``[G, N]`` float16, zeros ``[G, N]`` int32).

    Symmetric: zero 8 and ``scale = 2 max|w| / 15``; asymmetric: ``scale = (max - min) / 15``
    and ``zero = round(-min / scale)``. Not GPTQ's error-compensating algorithm: the format is
    what matters here (Octavo runs checkpoints, it does not make them).
    """
    n, k = weight.shape
    groups = group_index(k, group_size, g_idx, weight.device)
    num_groups = int(groups.max()) + 1
    w = weight.float().t()  # [K, N]
    scales = torch.empty(num_groups, n)
    zeros = torch.empty(num_groups, n, dtype=torch.int32)
    for g in range(num_groups):
        rows = w[groups == g]  # [members, N]
        if symmetric:
            scale = (2 * rows.abs().amax(dim=0) / 15).clamp(min=1e-6)
            zero = torch.full((n,), 8, dtype=torch.int32)
        else:
            low, high = rows.amin(dim=0).clamp(max=0), rows.amax(dim=0).clamp(min=0)
            scale = ((high - low) / 15).clamp(min=1e-6)
            zero = torch.round(-low / scale).clamp(0, 15).to(torch.int32)
        scales[g], zeros[g] = scale, zero
    scales = scales.to(torch.float16)
    values = torch.round(w / scales.float()[groups]) + zeros[groups]
    return values.clamp(0, 15).to(torch.int32), scales, zeros
