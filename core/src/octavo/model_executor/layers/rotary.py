"""Rotary position embedding (RoPE), "neox" layout: the head's two halves are rotated as pairs.

Supported ``rope_type``s (the frequencies of each checked against transformers' own
``ROPE_INIT_FUNCTIONS`` in ``tests/model_executor/test_rotary.py``):

- ``default``; ``linear`` (positions divided by ``factor``); ``llama3`` (Llama 3.1's
  frequency-dependent scaling);
- ``yarn`` (NTK-by-parts interpolation between ``beta_fast`` and ``beta_slow`` rotations, cos and
  sin scaled by its attention factor);
- ``dynamic`` (NTK: the base grows with the context length);
- ``longrope`` (Phi-3's per-frequency ``short_factor``/``long_factor``, old name ``su``; cos
  and sin scaled by its attention factor).

``dynamic`` and ``longrope`` depend on the length of the sequence in transformers, which
recomputes the frequencies (and, for Phi-3, the whole KV cache) as a sequence grows. A paged
cache keeps keys rotated once, so Octavo fixes them per engine from its context length
(``max_model_len``, as vLLM does): ``dynamic`` uses the base for that length (the plain base
while it is within ``max_position_embeddings``, as transformers does for every such
sequence); ``longrope`` uses the long factors when ``max_model_len`` exceeds
``original_max_position_embeddings``, else the short ones (transformers' choice for sequences
that stay within the original length).

A config may rotate only the first ``partial_rotary_factor`` of each head (Phi-4-mini: 0.75);
the rest passes through. Parameters are read from a ``transformers`` config in either form:

- transformers >= 5: ``config.rope_parameters = {"rope_type", "rope_theta", "factor", ...}``,
  or one such dict per layer type (Gemma 3: ``"sliding_attention"``, ``"full_attention"``);
- older: ``config.rope_theta`` plus an optional ``config.rope_scaling`` dict (``"type"`` or
  ``"rope_type"``).

On CUDA tensors ``RotaryEmbedding`` runs the Triton kernel of ``octavo.kernels.triton.rotary``
(query and key in one launch); on a host device the backend's kernel where it registered one
(``octavo.kernels.host_layer_kernels``); elsewhere ``forward_native``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from octavo.kernels.host_layer_kernels import host_layer_kernels
from octavo.kernels.triton_support import optional_triton_kernels

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "dynamic", "longrope")
# Older names of supported types.
_ROPE_ALIASES = {"su": "longrope"}
DEFAULT_ROPE_THETA = 10000.0


@dataclass(slots=True, frozen=True)
class RopeParameters:
    """What decides a model's rotary frequencies."""

    # One of SUPPORTED_ROPE_TYPES.
    rope_type: str
    # Base wavelength of the frequencies.
    theta: float
    # linear / llama3 / yarn / dynamic / longrope: how much longer the context is than the
    # one trained on (longrope: max_position_embeddings / original when not given).
    factor: float = 1.0
    # llama3: wavelengths longer than original_max / low_freq_factor are divided by factor.
    low_freq_factor: float = 1.0
    # llama3: wavelengths shorter than original_max / high_freq_factor are left alone.
    high_freq_factor: float = 4.0
    # llama3 / yarn / longrope: the context length the model was first trained with.
    original_max_position_embeddings: int = 8192
    # Fraction of each head that is rotated (the first dimensions); the rest passes through.
    partial_rotary_factor: float = 1.0
    # yarn / longrope: scale of cos and sin (None: derived from factor, as transformers does).
    attention_factor: float | None = None
    # yarn: the rotation counts bounding the interpolation ramp.
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    # yarn: attention factor from mscale / mscale_all_dim when both are given.
    mscale: float | None = None
    mscale_all_dim: float | None = None
    # yarn: round the ramp's bounds outwards to whole dimensions.
    truncate: bool = True
    # longrope: per-frequency divisors for contexts within / beyond the original length.
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    # dynamic / longrope: the model's max_position_embeddings.
    max_position_embeddings: int = 0
    # dynamic / longrope: the engine's context length the frequencies are fixed for (None:
    # max_position_embeddings).
    context_len: int | None = None


def rope_parameters_from_config(config: Any, layer_type: str | None = None,
                                context_len: int | None = None) -> RopeParameters:
    """Read the RoPE settings of a ``transformers`` config (new or old form).

    :param layer_type: the layer type whose parameters to read when the config has one dict
        per layer type (Gemma 3); ignored otherwise.
    :param context_len: the engine's ``max_model_len`` (dynamic / longrope, see the module
        docstring); ``None`` means ``max_position_embeddings``.

    Raises ``ValueError`` for a ``rope_type`` Octavo does not implement, naming the supported ones.
    """
    params = getattr(config, "rope_parameters", None)
    if params is None:
        params = getattr(config, "rope_scaling", None)
    params = dict(params or {})
    if params and "rope_type" not in params and "type" not in params and "rope_theta" not in params:
        # One dict per layer type.
        if layer_type is None or layer_type not in params:
            raise ValueError(f"the config has rope parameters per layer type ({sorted(params)}); "
                             f"got layer type {layer_type!r}")
        params = dict(params[layer_type] or {})
    rope_type = params.get("rope_type", params.get("type", "default"))
    rope_type = _ROPE_ALIASES.get(rope_type, rope_type)
    theta = params.get("rope_theta", getattr(config, "rope_theta", None))
    theta = float(theta) if theta is not None else DEFAULT_ROPE_THETA
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"rope_type {rope_type!r} is not supported by Octavo; "
            f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    max_positions = int(getattr(config, "max_position_embeddings", 0) or 0)
    common: dict[str, Any] = dict(partial_rotary_factor=float(params.get(
        "partial_rotary_factor", getattr(config, "partial_rotary_factor", None) or 1.0)))
    if rope_type == "default":
        return RopeParameters("default", theta, **common)
    if rope_type == "linear":
        return RopeParameters("linear", theta, factor=float(params["factor"]), **common)
    original_max = int(params.get(
        "original_max_position_embeddings",
        getattr(config, "original_max_position_embeddings", None) or max_positions or 8192))
    if rope_type == "llama3":
        return RopeParameters(
            "llama3", theta, factor=float(params["factor"]),
            low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
            original_max_position_embeddings=original_max, **common,
        )
    if rope_type == "dynamic":
        return RopeParameters("dynamic", theta, factor=float(params["factor"]),
                              max_position_embeddings=max_positions, context_len=context_len,
                              **common)
    attention_factor = params.get("attention_factor")
    attention_factor = float(attention_factor) if attention_factor is not None else None
    if rope_type == "yarn":
        factor = params.get("factor")
        return RopeParameters(
            "yarn", theta,
            factor=float(factor) if factor is not None else max_positions / original_max,
            original_max_position_embeddings=original_max, attention_factor=attention_factor,
            beta_fast=float(params.get("beta_fast") or 32.0),
            beta_slow=float(params.get("beta_slow") or 1.0),
            mscale=params.get("mscale"), mscale_all_dim=params.get("mscale_all_dim"),
            truncate=bool(params.get("truncate", True)), **common,
        )
    factor = params.get("factor")  # longrope
    return RopeParameters(
        "longrope", theta,
        factor=float(factor) if factor is not None else max_positions / original_max,
        original_max_position_embeddings=original_max, attention_factor=attention_factor,
        short_factor=tuple(float(f) for f in params["short_factor"]),
        long_factor=tuple(float(f) for f in params["long_factor"]),
        max_position_embeddings=max_positions, context_len=context_len, **common,
    )


def rope_layer_type(config: Any, layer_index: int) -> str | None:
    """The layer type whose rope parameters layer ``layer_index`` uses when the config has one
    set per layer type (Gemma 3), else ``None``."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    if not isinstance(params, dict) or not params or any(
            key in params for key in ("rope_type", "type", "rope_theta")):
        return None
    return str(config.layer_types[layer_index])


def rotary_dim_of(head_dim: int, params: RopeParameters) -> int:
    """How many leading dimensions of each head are rotated."""
    return int(head_dim * params.partial_rotary_factor)


def compute_inv_freq(rotary_dim: int, params: RopeParameters) -> torch.Tensor:  # [rotary_dim // 2]
    """Inverse frequency of each rotated pair, float32 (same arithmetic as ``transformers``)."""
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).to(torch.float32) / rotary_dim
    if params.rope_type == "dynamic":
        return 1.0 / (_dynamic_base(rotary_dim, params) ** exponents)
    if params.rope_type == "yarn":
        return _yarn_inv_freq(rotary_dim, params, exponents)
    if params.rope_type == "longrope":
        factors = torch.tensor(
            params.long_factor if _uses_long_factors(params) else params.short_factor,
            dtype=torch.float32)
        if factors.shape != exponents.shape:
            raise ValueError(f"longrope factors have {factors.numel()} entries, the rotary "
                             f"dimension {rotary_dim} needs {exponents.numel()}")
        return 1.0 / (factors * params.theta**exponents)
    inv_freq = 1.0 / (params.theta**exponents)
    if params.rope_type == "linear":
        return inv_freq / params.factor
    if params.rope_type == "llama3":
        return _llama3_scale(inv_freq, params)
    return inv_freq


def attention_scaling(params: RopeParameters) -> float:
    """The factor cos and sin are multiplied by (transformers' ``attention_scaling``)."""
    factor = params.factor
    if params.rope_type == "yarn":
        if params.attention_factor is not None:
            return params.attention_factor
        if params.mscale and params.mscale_all_dim:
            return float(_yarn_mscale(factor, params.mscale)
                         / _yarn_mscale(factor, params.mscale_all_dim))
        return _yarn_mscale(factor)
    if params.rope_type == "longrope":
        if params.attention_factor is not None:
            return params.attention_factor
        if factor <= 1.0:
            return 1.0
        return math.sqrt(1 + math.log(factor) / math.log(params.original_max_position_embeddings))
    return 1.0


def _dynamic_base(rotary_dim: int, params: RopeParameters) -> float:
    """NTK-scaled base for ``context_len`` (the plain base up to max_position_embeddings)."""
    max_positions = params.max_position_embeddings
    seq_len = max(params.context_len or max_positions, max_positions)
    factor = params.factor
    return params.theta * ((factor * seq_len / max_positions) - (factor - 1)) ** (
        rotary_dim / (rotary_dim - 2))


def _uses_long_factors(params: RopeParameters) -> bool:
    context_len = params.context_len or params.max_position_embeddings
    return context_len > params.original_max_position_embeddings


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_inv_freq(rotary_dim: int, params: RopeParameters,
                   exponents: torch.Tensor) -> torch.Tensor:
    """Interpolated (divided by factor) for low frequencies, extrapolated (kept) for high
    ones, with a linear ramp over the dimensions in between."""
    base, factor = params.theta, params.factor
    original_max = params.original_max_position_embeddings

    def correction_dim(num_rotations: float) -> float:
        return (rotary_dim * math.log(original_max / (num_rotations * 2 * math.pi))) / (
            2 * math.log(base))

    low, high = correction_dim(params.beta_fast), correction_dim(params.beta_slow)
    if params.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = torch.clamp(
        (torch.arange(rotary_dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp  # [rotary_dim // 2]: 1 keeps a frequency, 0 divides it by factor
    pos_freqs = base**exponents
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


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

    Keeps a float32 ``[max_positions, rotary_dim]`` table (``cos | sin`` halves, times the rope
    type's attention scaling) built on the current default device; positions must be
    ``< max_positions``. The first ``rotary_dim`` dimensions of each head are rotated (all of
    them unless ``params.partial_rotary_factor < 1``), the others pass through. One instance is
    shared by every layer of a model (of a layer type, for Gemma 3).
    """

    def __init__(self, head_dim: int, max_positions: int, params: RopeParameters) -> None:
        super().__init__()
        rotary_dim = rotary_dim_of(head_dim, params)
        if rotary_dim % 2 != 0 or rotary_dim < 2:
            raise ValueError(f"rotary dimension must be even and >= 2, got {rotary_dim} "
                             f"(head_dim {head_dim}, partial_rotary_factor "
                             f"{params.partial_rotary_factor})")
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim
        self.max_positions = max_positions
        self.params = params
        inv_freq = compute_inv_freq(rotary_dim, params)  # [rotary_dim // 2]
        scaling = attention_scaling(params)
        positions = torch.arange(max_positions, dtype=torch.int64).to(torch.float32)
        # [max_positions, rotary_dim // 2]
        freqs = torch.outer(positions, inv_freq.to(positions.device))
        cos_sin = torch.cat([freqs.cos() * scaling, freqs.sin() * scaling], dim=-1)
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
        if not query.is_cuda:
            host = host_layer_kernels(query.device.type)
            # The host kernel rotates whole heads: partial rotary stays on the torch code.
            if (host is not None and host.rotary_neox is not None
                    and self.rotary_dim == self.head_dim):
                return host.rotary_neox(positions, query, key, self.cos_sin_cache)
            return self.forward_native(positions, query, key)
        kernels = optional_triton_kernels("rotary")
        if kernels is None:
            return self.forward_native(positions, query, key)
        return self.forward_triton(kernels.apply_rotary, positions, query, key)

    def neox_table(self) -> torch.Tensor | None:
        """``cos_sin_cache`` when every dimension of a head is rotated (a backend's fused
        rotation may take it: ``octavo.attention.base.Rotation``), else ``None``."""
        return self.cos_sin_cache if self.rotary_dim == self.head_dim else None

    def forward_triton(
        self,
        apply_rotary: Any,  # octavo.kernels.triton.rotary.apply_rotary
        positions: torch.Tensor,  # [num_tokens] int64
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``forward`` through the Triton kernel (tests call it under the interpreter)."""
        if self.rotary_dim == self.head_dim:
            return apply_rotary(positions, query, key, self.cos_sin_cache)
        # Partial: rotate the leading dimensions of copies in place, the rest stays.
        query, key = query.clone(), key.clone()
        apply_rotary(positions, query[..., : self.rotary_dim], key[..., : self.rotary_dim],
                     self.cos_sin_cache, inplace=True)
        return query, key

    def forward_native(
        self,
        positions: torch.Tensor,  # [num_tokens] int64
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``forward`` with torch ops only (the CPU path and the kernel's reference)."""
        cos_sin = self.cos_sin_cache[positions]  # [num_tokens, rotary_dim]
        cos, sin = cos_sin.unsqueeze(1).chunk(2, dim=-1)  # [num_tokens, 1, rotary_dim // 2] each
        if self.rotary_dim == self.head_dim:
            return _rotate(query, cos, sin), _rotate(key, cos, sin)
        rot = self.rotary_dim
        return (torch.cat([_rotate(query[..., :rot], cos, sin), query[..., rot:]], dim=-1),
                torch.cat([_rotate(key[..., :rot], cos, sin), key[..., rot:]], dim=-1))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs ``(x[i], x[i + d/2])`` by the angle whose cos/sin are given."""
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)  # [num_tokens, heads, head_dim // 2] each
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def get_rope(config: Any, head_dim: int, layer_type: str | None = None,
             max_model_len: int | None = None) -> RotaryEmbedding:
    """The rotary embedding a ``transformers`` config asks for (for ``layer_type`` when its
    parameters are per layer type), sized to ``max(max_position_embeddings, max_model_len)``
    positions; ``max_model_len`` also fixes dynamic and longrope scaling (module docstring)."""
    params = rope_parameters_from_config(config, layer_type, context_len=max_model_len)
    max_positions = max(int(config.max_position_embeddings), max_model_len or 0)
    return RotaryEmbedding(head_dim, max_positions, params)
