"""Rotary position embedding (RoPE), "neox" layout: the head's two halves are rotated as pairs.

Supported ``rope_type``s: ``default``, ``linear`` (positions divided by ``factor``) and
``llama3`` (Llama 3.1's frequency-dependent scaling). Parameters are read from a
``transformers`` config in either form:

- transformers >= 5: ``config.rope_parameters = {"rope_type", "rope_theta", "factor", ...}``;
- older: ``config.rope_theta`` plus an optional ``config.rope_scaling`` dict (``"type"`` or
  ``"rope_type"``).

On CUDA tensors ``RotaryEmbedding`` runs the Triton kernel of ``octavo.kernels.triton.rotary``
(query and key in one launch); elsewhere, or without Triton, ``forward_native``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from octavo.kernels.triton_support import optional_triton_kernels

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
DEFAULT_ROPE_THETA = 10000.0


@dataclass(slots=True, frozen=True)
class RopeParameters:
    """What decides a model's rotary frequencies."""

    # One of SUPPORTED_ROPE_TYPES.
    rope_type: str
    # Base wavelength of the frequencies.
    theta: float
    # linear / llama3: how much longer the context is than the one trained on.
    factor: float = 1.0
    # llama3: wavelengths longer than original_max / low_freq_factor are divided by factor.
    low_freq_factor: float = 1.0
    # llama3: wavelengths shorter than original_max / high_freq_factor are left alone.
    high_freq_factor: float = 4.0
    # llama3: the context length the model was first trained with.
    original_max_position_embeddings: int = 8192


def rope_parameters_from_config(config: Any) -> RopeParameters:
    """Read the RoPE settings of a ``transformers`` config (new or old form).

    Raises ``ValueError`` for a ``rope_type`` Octavo does not implement, naming the supported ones.
    """
    params = getattr(config, "rope_parameters", None)
    if params is None:
        params = getattr(config, "rope_scaling", None)
    params = dict(params or {})
    rope_type = params.get("rope_type", params.get("type", "default"))
    theta = params.get("rope_theta", getattr(config, "rope_theta", None))
    theta = float(theta) if theta is not None else DEFAULT_ROPE_THETA
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"rope_type {rope_type!r} is not supported by Octavo; "
            f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if rope_type == "default":
        return RopeParameters("default", theta)
    if rope_type == "linear":
        return RopeParameters("linear", theta, factor=float(params["factor"]))
    original_max = params.get(
        "original_max_position_embeddings", getattr(config, "max_position_embeddings", 8192)
    )
    return RopeParameters(
        "llama3",
        theta,
        factor=float(params["factor"]),
        low_freq_factor=float(params["low_freq_factor"]),
        high_freq_factor=float(params["high_freq_factor"]),
        original_max_position_embeddings=int(original_max),
    )


def compute_inv_freq(head_dim: int, params: RopeParameters) -> torch.Tensor:  # [head_dim // 2]
    """Inverse frequency of each rotated pair, float32 (same arithmetic as ``transformers``)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    inv_freq = 1.0 / (params.theta**exponents)
    if params.rope_type == "linear":
        return inv_freq / params.factor
    if params.rope_type == "llama3":
        return _llama3_scale(inv_freq, params)
    return inv_freq


def _llama3_scale(inv_freq: torch.Tensor, params: RopeParameters) -> torch.Tensor:
    """Divide low frequencies by ``factor``, keep high ones, blend smoothly in between."""
    original_max = params.original_max_position_embeddings
    low_freq_wavelen = original_max / params.low_freq_factor
    high_freq_wavelen = original_max / params.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / params.factor, inv_freq)
    smooth = (original_max / wavelen - params.low_freq_factor) / (
        params.high_freq_factor - params.low_freq_factor
    )
    blended = (1 - smooth) * scaled / params.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, blended, scaled)


class RotaryEmbedding(nn.Module):
    """Applies RoPE to query and key heads at given positions.

    Keeps a float32 ``[max_positions, head_dim]`` table (``cos | sin`` halves) built on the
    current default device; positions must be ``< max_positions``. One instance is shared by
    every layer of a model.
    """

    def __init__(self, head_dim: int, max_positions: int, params: RopeParameters) -> None:
        super().__init__()
        if head_dim % 2 != 0:
            raise ValueError(f"rotary head_dim must be even, got {head_dim}")
        self.head_dim = head_dim
        self.max_positions = max_positions
        self.params = params
        inv_freq = compute_inv_freq(head_dim, params)  # [head_dim // 2]
        positions = torch.arange(max_positions, dtype=torch.int64).to(torch.float32)
        freqs = torch.outer(positions, inv_freq.to(positions.device))  # [max_positions, head_dim // 2]
        cos_sin = torch.cat([freqs.cos(), freqs.sin()], dim=-1)  # [max_positions, head_dim]
        self.register_buffer("cos_sin_cache", cos_sin, persistent=False)

    def forward(
        self,
        positions: torch.Tensor,  # [num_tokens] int64
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotated copies of ``query`` and ``key`` (the inputs are left untouched).

        CUDA tensors go through the Triton kernel (same math, see
        ``octavo.kernels.triton.rotary``), others through ``forward_native``.
        """
        kernels = optional_triton_kernels("rotary") if query.is_cuda else None
        if kernels is None:
            return self.forward_native(positions, query, key)
        return kernels.apply_rotary(positions, query, key, self.cos_sin_cache)

    def forward_native(
        self,
        positions: torch.Tensor,  # [num_tokens] int64
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``forward`` with torch ops only (the CPU path and the kernel's reference)."""
        cos_sin = self.cos_sin_cache[positions]  # [num_tokens, head_dim]
        cos, sin = cos_sin.unsqueeze(1).chunk(2, dim=-1)  # [num_tokens, 1, head_dim // 2] each
        return _rotate(query, cos, sin), _rotate(key, cos, sin)




def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs ``(x[i], x[i + d/2])`` by the angle whose cos/sin are given."""
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)  # [num_tokens, heads, head_dim // 2] each
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def get_rope(config: Any, head_dim: int) -> RotaryEmbedding:
    """The rotary embedding a ``transformers`` config asks for, sized to its max positions."""
    params = rope_parameters_from_config(config)
    return RotaryEmbedding(head_dim, int(config.max_position_embeddings), params)
