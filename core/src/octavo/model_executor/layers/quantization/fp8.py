"""``fp8``: e4m3 weights with float32 scales, from a checkpoint or quantized while loading.

Checkpoints with ``quantization_config.quant_method == "fp8"``, as two tool families write them
(the tensors of a linear layer ``P`` are ``P.weight`` in ``float8_e4m3fn`` plus):

- per-tensor scale: ``P.weight_scale`` (vLLM / llm-compressor / AutoFP8) or
  ``P.weight_scale_inv`` (transformers' FineGrainedFP8 without ``weight_block_size``), a scalar;
- block scales (``weight_block_size: [bn, bk]``, FineGrainedFP8 / DeepSeek): ``P.weight_scale_inv``
  ``[ceil(N/bn), ceil(K/bk)]``;
- ``activation_scheme: "static"``: one activation scale per layer, ``P.input_scale`` (or
  FineGrainedFP8's ``P.activation_scale``); ``"dynamic"`` (default): per-token scales computed
  on the fly.

Despite its name ``weight_scale_inv`` multiplies, like ``weight_scale``: ``W = W_fp8 * scale``.
Modules named in ``modules_to_not_convert`` / ``ignored_layers`` stay dense.

``--quantization fp8`` on a dense checkpoint quantizes each linear weight while loading, with one
scale per output channel (and per-token activation scales).

After loading, per-tensor scales of merged projections (q/k/v, gate/up) are spread over their
output channels, so every layer holds one float32 scale per channel: the matmul
(``octavo.kernels.fp8.fp8_linear``) takes the same form whatever the checkpoint held.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import torch
from torch import nn

from octavo.kernels.fp8 import (
    FP8_DTYPE,
    dequantize_fp8,
    fp8_linear,
    quantize_fp8_per_channel,
)
from octavo.model_executor.layers.quantization.base import (
    LinearMethod,
    LinearShape,
    QuantizationConfig,
    QuantizationSource,
    add_param,
    replace_param,
)
from octavo.model_executor.layers.weights import ParamLayout

# Scales with one value per merged projection (a per-tensor scale of each).
PER_SHARD = ParamLayout(output_dim=None, input_dim=None, per_shard=True)
# One value per output channel.
PER_CHANNEL = ParamLayout(output_dim=0, input_dim=None)


def is_ignored(name: str, patterns: Sequence[str]) -> bool:
    """Whether module ``name`` matches an ignore list: ``re:<regex>`` (compressed-tensors),
    else a whole dotted part of the name (``lm_head``, ``model.layers.0.mlp``)."""
    for pattern in patterns:
        if pattern.startswith("re:"):
            if re.match(pattern[3:], name):
                return True
        elif f".{pattern}." in f".{name}.":
            return True
    return False


def ignored_layer(prefix: str, shard_names: tuple[str, ...], patterns: Sequence[str]) -> bool:
    """Whether the linear layer ``prefix`` (merging ``shard_names``) is left unquantized; all
    its projections must agree."""
    parent = prefix.rpartition(".")[0]
    names = [f"{parent}.{s}" if parent else s for s in shard_names] or [prefix]
    flags = {is_ignored(name, patterns) for name in names}
    if len(flags) > 1:
        raise ValueError(
            f"the checkpoint quantizes some of {', '.join(names)} but not all; Octavo runs "
            "them as one merged layer, which must be all quantized or all dense")
    return flags.pop()


class Fp8Config(QuantizationConfig):
    """Settings of an fp8 checkpoint, or of quantizing a dense one while loading."""

    name = "fp8"
    checkpoint_methods = ("fp8",)
    quantizes_dense_checkpoints = True

    def __init__(self, checkpoint_is_fp8: bool, static_activations: bool = False,
                 block: tuple[int, int] | None = None, ignored: Sequence[str] = (),
                 per_channel: bool = False) -> None:
        super().__init__()
        # The checkpoint holds fp8 weights (else: dense weights quantized while loading).
        self.checkpoint_is_fp8 = checkpoint_is_fp8
        # The checkpoint's weight scales are per output channel, [N, 1] (compressed-tensors'
        # "channel" strategy); else per tensor, or per block when ``block`` is set.
        self.per_channel = per_channel
        # One activation scale per layer from the checkpoint (else per token, on the fly).
        self.static_activations = static_activations
        # (bn, bk) of block scales, None for per-tensor scales.
        self.block = block
        # Module-name patterns left dense.
        self.ignored = tuple(ignored)

    @classmethod
    def from_source(cls, source: QuantizationSource) -> Fp8Config:
        config = source.hf_quant_config
        if config is None:
            return cls(checkpoint_is_fp8=False)
        scheme = str(config.get("activation_scheme", "dynamic")).lower()
        if scheme not in ("dynamic", "static"):
            raise ValueError(f"fp8 checkpoint: activation_scheme {scheme!r} is not one of "
                             "dynamic, static")
        block = config.get("weight_block_size")
        if block is not None:
            if len(block) != 2 or not all(isinstance(b, int) and b > 0 for b in block):
                raise ValueError(f"fp8 checkpoint: weight_block_size must be two positive "
                                 f"integers, got {block!r}")
            block = (int(block[0]), int(block[1]))
        fmt = config.get("fmt", config.get("scale_fmt", "e4m3"))
        if fmt not in ("e4m3", "float"):
            raise ValueError(f"fp8 checkpoint: format {fmt!r} is not supported (e4m3 weights "
                             "with float32 scales only)")
        ignored = (config.get("modules_to_not_convert") or config.get("ignored_layers") or [])
        return cls(True, scheme == "static", block, ignored)

    def linear_method(self, prefix: str, shard_names: tuple[str, ...]) -> LinearMethod | None:
        if ignored_layer(prefix, shard_names, self.ignored):
            return None
        return Fp8LinearMethod(self)

    def describe(self) -> str:
        if not self.checkpoint_is_fp8:
            return "fp8 (weights quantized while loading, one scale per output channel)"
        scales = (f"{self.block[0]}x{self.block[1]} block" if self.block else
                  "per-channel" if self.per_channel else "per-tensor")
        acts = "static" if self.static_activations else "per-token dynamic"
        return f"fp8 checkpoint ({scales} weight scales, {acts} activation scales)"


class Fp8LinearMethod(LinearMethod):
    """Parameters ``weight`` (e4m3) and ``weight_scale`` (+ ``input_scale`` when static)."""

    checkpoint_aliases = {"weight_scale_inv": "weight_scale", "activation_scale": "input_scale"}

    def __init__(self, config: Fp8Config) -> None:
        self.config = config

    def create_weights(self, layer: nn.Module, shape: LinearShape) -> None:
        n, k = shape.output_size, shape.input_size
        layer.fp8_output_sizes = shape.output_sizes
        if not self.config.checkpoint_is_fp8:  # dense now, fp8 after loading
            add_param(layer, "weight", torch.empty(n, k, dtype=shape.params_dtype))
            return
        add_param(layer, "weight", torch.empty(n, k, dtype=FP8_DTYPE))
        block = self.config.block
        if block is not None:
            bn, bk = block
            if k % bk or any(size % bn for size in shape.output_sizes):
                raise ValueError(
                    f"fp8 checkpoint with {bn}x{bk} weight blocks: this rank's part of a layer "
                    f"({shape.output_sizes} outputs x {k} inputs) is not a whole number of "
                    "blocks; use a tensor_parallel_size that keeps every split on block "
                    "boundaries")
            add_param(layer, "weight_scale", torch.empty(n // bn, k // bk, dtype=torch.float32),
                      ParamLayout(output_dim=0, input_dim=1, output_ratio=(bn, 1),
                                  input_ratio=(bk, 1)))
        elif self.config.per_channel:
            add_param(layer, "weight_scale", torch.empty(n, 1, dtype=torch.float32),
                      ParamLayout(output_dim=0, input_dim=None))
        else:
            add_param(layer, "weight_scale",
                      torch.empty(len(shape.output_sizes), dtype=torch.float32), PER_SHARD)
        if self.config.static_activations:
            add_param(layer, "input_scale",
                      torch.empty(len(shape.output_sizes), dtype=torch.float32), PER_SHARD)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        sizes = torch.tensor(layer.fp8_output_sizes, device=layer.weight.device)
        if not self.config.checkpoint_is_fp8:
            weight, scale = quantize_fp8_per_channel(layer.weight.data)
            replace_param(layer, "weight", weight)
            add_param(layer, "weight_scale", scale, PER_CHANNEL)
            return
        if self.config.per_channel:  # [N, 1] -> [N]
            replace_param(layer, "weight_scale", layer.weight_scale.data.reshape(-1))
        elif self.config.block is None:  # per projection -> per output channel
            replace_param(layer, "weight_scale",
                          layer.weight_scale.data.repeat_interleave(sizes).contiguous())
        if self.config.static_activations:  # one scale for the shared input
            replace_param(layer, "input_scale", layer.input_scale.data.max())

    def apply(self, layer: nn.Module, x: torch.Tensor,
              bias: torch.Tensor | None) -> torch.Tensor:
        return fp8_linear(x, layer.weight, layer.weight_scale, bias,
                          getattr(layer, "input_scale", None), self.config.block)

    def dequantized_weight(self, layer: nn.Module, dtype: torch.dtype) -> torch.Tensor:
        """The dense weight this layer multiplies by (tests, debugging)."""
        return dequantize_fp8(layer.weight, layer.weight_scale, dtype, self.config.block)

    def fill_dummy_weights(self, layer: nn.Module, generator: torch.Generator) -> None:
        dense = torch.empty(layer.weight.shape, device=layer.weight.device)
        dense.normal_(0.0, 0.02, generator=generator)
        if not self.config.checkpoint_is_fp8:
            layer.weight.copy_(dense)
            return
        scale = float(dense.abs().max()) / 448.0  # one scale for every channel / block
        layer.weight.copy_((dense / scale).to(FP8_DTYPE))
        layer.weight_scale.fill_(scale)
        if self.config.static_activations:
            layer.input_scale.fill_(0.05)

