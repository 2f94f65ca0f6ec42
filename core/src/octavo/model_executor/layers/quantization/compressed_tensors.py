"""``compressed-tensors``: llm-compressor's checkpoint format, for its FP8 schemes.

The checkpoint's ``quantization_config`` has ``quant_method: "compressed-tensors"``,
``format: "float-quantized"`` (or ``"naive-quantized"``) and ``config_groups`` whose group
targets ``Linear`` with ``weights: {num_bits: 8, type: "float", strategy: "tensor" | "channel"
| "block", block_structure: [bn, bk]}`` and optional ``input_activations`` (``dynamic: true``:
per-token scales on the fly; ``false``: a static per-tensor scale). A linear layer ``P`` stores
``P.weight`` (``float8_e4m3fn``), ``P.weight_scale`` (``[1]`` per tensor, ``[N, 1]`` per
channel, ``[N/bn, K/bk]`` per block) and, static, ``P.input_scale``. ``ignore`` lists modules
left dense (names, or ``re:`` regular expressions).

These run exactly as ``fp8`` checkpoints do (``Fp8LinearMethod``); other schemes (int4/int8
packed weights, FP4) are refused with the scheme named.
"""

from __future__ import annotations

from typing import Any

from octavo.model_executor.layers.quantization.base import QuantizationSource
from octavo.model_executor.layers.quantization.fp8 import Fp8Config

_FP8_FORMATS = ("float-quantized", "naive-quantized")


class CompressedTensorsConfig(Fp8Config):
    """An FP8 compressed-tensors checkpoint (W8A8-FP8 or W8A16-FP8)."""

    name = "compressed-tensors"
    checkpoint_methods = ("compressed-tensors",)
    quantizes_dense_checkpoints = False

    @classmethod
    def from_source(cls, source: QuantizationSource) -> CompressedTensorsConfig:
        config = source.hf_quant_config
        if config is None:
            raise ValueError("compressed-tensors needs a checkpoint with a quantization_config")
        fmt = config.get("format")
        groups = list((config.get("config_groups") or {}).values())
        if len(groups) != 1:
            raise ValueError(
                f"compressed-tensors checkpoint with {len(groups)} config groups: Octavo runs "
                "one FP8 group targeting Linear layers")
        group = groups[0]
        weights: dict[str, Any] = group.get("weights") or {}
        if fmt not in _FP8_FORMATS or weights.get("type") != "float" or \
                weights.get("num_bits") != 8:
            raise ValueError(
                f"compressed-tensors scheme (format {fmt!r}, weights {weights.get('type')!r} "
                f"{weights.get('num_bits')}-bit) is not supported: Octavo runs its FP8 schemes "
                f"(format {' or '.join(_FP8_FORMATS)}, 8-bit float weights)")
        if "Linear" not in (group.get("targets") or []):
            raise ValueError("compressed-tensors checkpoint: the FP8 group must target Linear "
                             f"layers, got targets {group.get('targets')!r}")
        strategy = weights.get("strategy", "tensor")
        block = None
        if strategy == "block":
            block = tuple(int(b) for b in weights.get("block_structure") or ())
            if len(block) != 2:
                raise ValueError("compressed-tensors block strategy needs block_structure "
                                 f"[bn, bk], got {weights.get('block_structure')!r}")
        elif strategy not in ("tensor", "channel"):
            raise ValueError(f"compressed-tensors FP8 weight strategy {strategy!r} is not "
                             "supported (tensor, channel, block)")
        activations = group.get("input_activations")
        static = activations is not None and not activations.get("dynamic", True)
        if static and activations.get("strategy", "tensor") != "tensor":
            raise ValueError("compressed-tensors static activation scales must be per tensor, "
                             f"got strategy {activations.get('strategy')!r}")
        return cls(True, static, block, config.get("ignore") or [],
                   per_channel=strategy == "channel")
