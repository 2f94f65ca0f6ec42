"""``gptq`` and ``awq``: 4-bit weight-only checkpoints (packings in ``octavo.kernels.int4``).

GPTQ (``quant_method: "gptq"``): ``bits: 4``, ``group_size`` (``-1``: one group over all
inputs), ``desc_act`` (act-order: ``g_idx`` permutes the groups), ``sym``, and
``checkpoint_format`` ``"gptq"`` (zeros stored minus one; the default) or ``"gptq_v2"``. A layer
``P`` stores ``P.qweight`` int32 ``[K/8, N]``, ``P.qzeros`` int32 ``[G, N/8]``, ``P.scales``
float16 ``[G, N]`` and ``P.g_idx`` int32 ``[K]`` (optional without act-order).

AWQ (``quant_method: "awq"``, ``version: "gemm"``): ``bits``/``w_bit`` 4, ``group_size``/
``q_group_size``, ``zero_point`` true; ``P.qweight`` int32 ``[K, N/8]`` and ``P.qzeros`` int32
``[G, N/8]`` in AWQ's interleaved order, ``P.scales`` float16 ``[G, N]``.

After loading, both hold what the matmul reads (``int4_linear``): ``qweight`` int32
``[K/8, N]`` (AWQ repacked once), ``scales`` and unpacked ``zeros`` float16 ``[G, N]``, and
``g_idx`` only for act-order weights. A backend whose kernels read another arrangement of the
same words best gives ``kernels.int4_prepare_qweight(qweight, group_size, g_idx)``, called
once per layer at the end of loading; it returns ``qweight`` itself or the words in 32-output
panels (``octavo.kernels.int4.to_panels``), which every int4 kernel reads. Under tensor
parallelism a row-parallel layer of an act-order checkpoint keeps every group's scales (its
inputs belong to any group); otherwise each rank keeps the groups of its inputs, so the split
must fall on a group boundary.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from octavo.kernels.int4 import (
    dequantize_int4,
    int4_linear,
    pack_rows,
    unpack_awq,
    unpack_cols,
    word_shape,
)
from octavo.model_executor.layers.quantization.base import (
    LinearMethod,
    LinearShape,
    QuantizationConfig,
    QuantizationSource,
    add_param,
    replace_param,
)
from octavo.model_executor.layers.quantization.fp8 import ignored_layer
from octavo.model_executor.layers.weights import ParamLayout

PACK = 8


def _group_size(value: Any, what: str) -> int:
    group_size = int(value if value is not None else 128)
    if group_size != -1 and (group_size <= 0 or group_size % PACK):
        raise ValueError(f"{what}: group_size must be -1 or a positive multiple of 8, "
                         f"got {value!r}")
    return group_size


class Int4LinearMethod(LinearMethod):
    """Shared by GPTQ and AWQ: after loading, ``qweight [K/8, N]``, ``scales``/``zeros``
    ``[G, N]``, ``g_idx`` (or None) and the group size, multiplied by ``int4_linear`` (with
    the backend's ``kernels.int4_matmul`` first, where it has one)."""

    def __init__(self, config: GPTQConfig | AWQConfig) -> None:
        self.config = config
        self.group_size = config.group_size  # -1: the whole input

    def _groups(self, shape: LinearShape, keep_all: bool) -> tuple[int, int, bool]:
        """(group size in inputs, groups held, whether scales follow the rank's inputs)."""
        full = shape.full_input_size
        size = full if self.group_size == -1 else self.group_size
        if full % size:
            raise ValueError(f"{full} input features do not split into groups of {size}")
        split = shape.input_is_split and not keep_all and self.group_size != -1
        held = (shape.input_size if split else full) // size
        return size, held, split

    def _prepare_for_kernels(self, layer: nn.Module) -> None:
        """The words in the layout the backend's kernels ask for, where they ask
        (``kernels.int4_prepare_qweight``; module docstring)."""
        prepare = getattr(self.config.kernels, "int4_prepare_qweight", None)
        if prepare is None:
            return
        words = prepare(layer.qweight.data, layer.int4_group_size, layer.int4_g_idx)
        if words is not layer.qweight.data:
            if word_shape(words) != word_shape(layer.qweight.data):
                raise ValueError(f"int4_prepare_qweight returned {tuple(words.shape)} words "
                                 f"for qweight {tuple(layer.qweight.shape)}")
            replace_param(layer, "qweight", words)

    def apply(self, layer: nn.Module, x: torch.Tensor,
              bias: torch.Tensor | None) -> torch.Tensor:
        return int4_linear(x, layer.qweight, layer.scales, layer.zeros, layer.int4_group_size,
                           layer.int4_g_idx, bias, self.config.kernels)

    def apply_add_rms_norm(self, layer: nn.Module, x: torch.Tensor, residual: torch.Tensor,
                           norm_weight: torch.Tensor, eps: float,
                           bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The backend's ``kernels.int4_matmul_add_rms_norm(x, residual, norm_weight, eps,
        qweight, scales, zeros, group_size, g_idx)`` where it has one and takes the call
        (``(out, x + residual)``, or ``None``)."""
        fused = getattr(self.config.kernels, "int4_matmul_add_rms_norm", None)
        if fused is None:
            return None
        done = fused(x, residual, norm_weight, eps, layer.qweight, layer.scales, layer.zeros,
                     layer.int4_group_size, layer.int4_g_idx)
        if done is None:
            return None
        out, new_residual = done
        return (out if bias is None else out + bias), new_residual

    def dequantized_weight(self, layer: nn.Module, dtype: torch.dtype) -> torch.Tensor:
        """The dense ``[N, K]`` weight this layer multiplies by (tests, debugging)."""
        return dequantize_int4(layer.qweight, layer.scales, layer.zeros, layer.int4_group_size,
                               layer.int4_g_idx, dtype)

    def fill_dummy_weights(self, layer: nn.Module, generator: torch.Generator) -> None:
        layer.qweight.random_(-2**31, 2**31 - 1, generator=generator)
        layer.qzeros.random_(-2**31, 2**31 - 1, generator=generator)
        layer.scales.fill_(0.02 / 4)
        g_idx = getattr(layer, "g_idx", None)
        if g_idx is not None:
            groups = layer.scales.shape[0]
            g_idx.copy_(torch.arange(g_idx.numel(), device=g_idx.device) * groups
                        // g_idx.numel())


class GPTQConfig(QuantizationConfig):
    """A GPTQ checkpoint (AutoGPTQ / GPTQModel / optimum)."""

    name = "gptq"
    checkpoint_methods = ("gptq",)

    def __init__(self, group_size: int, desc_act: bool, sym: bool, zeros_minus_one: bool,
                 ignored: tuple[str, ...] = ()) -> None:
        super().__init__()
        self.group_size = group_size
        self.desc_act = desc_act
        self.sym = sym
        # checkpoint_format "gptq" (v1) stores zero - 1; "gptq_v2" the zero.
        self.zeros_minus_one = zeros_minus_one
        self.ignored = ignored

    @classmethod
    def from_source(cls, source: QuantizationSource) -> GPTQConfig:
        config = source.hf_quant_config or {}
        bits = config.get("bits", 4)
        if bits != 4:
            raise ValueError(f"gptq checkpoint with {bits}-bit weights: Octavo runs 4-bit GPTQ "
                             "only")
        fmt = str(config.get("checkpoint_format", config.get("format", "gptq"))).lower()
        if fmt not in ("gptq", "gptq_v2"):
            raise ValueError(f"gptq checkpoint_format {fmt!r} is not supported (gptq, gptq_v2; "
                             "marlin/bitblas-packed checkpoints are not)")
        if config.get("lm_head"):
            raise ValueError("gptq checkpoint with a quantized lm_head: not supported; use one "
                             "whose lm_head is dense")
        if config.get("dynamic"):
            raise ValueError("gptq checkpoint with per-module 'dynamic' overrides: not "
                             "supported")
        return cls(_group_size(config.get("group_size"), "gptq"),
                   bool(config.get("desc_act", False)), bool(config.get("sym", True)),
                   fmt == "gptq", tuple(config.get("modules_to_not_convert") or ()))

    def linear_method(self, prefix: str, shard_names: tuple[str, ...]) -> LinearMethod | None:
        if ignored_layer(prefix, shard_names, self.ignored):
            return None
        return GPTQLinearMethod(self)

    def describe(self) -> str:
        return (f"gptq 4-bit, group size {self.group_size}, "
                f"{'act-order, ' if self.desc_act else ''}{'sym' if self.sym else 'asym'}, "
                f"{'v1' if self.zeros_minus_one else 'v2'} zeros")


class GPTQLinearMethod(Int4LinearMethod):
    config: GPTQConfig

    def create_weights(self, layer: nn.Module, shape: LinearShape) -> None:
        n, k = shape.output_size, shape.input_size
        size, groups, split = self._groups(shape, keep_all=self.config.desc_act)
        if k % PACK or any(s % PACK for s in shape.output_sizes):
            raise ValueError(f"gptq layer of {k} inputs x {shape.output_sizes} outputs on this "
                             "rank: both must be multiples of 8")
        group_dim = 0 if split else None
        add_param(layer, "qweight", torch.empty(k // PACK, n, dtype=torch.int32),
                  ParamLayout(output_dim=1, input_dim=0, input_ratio=(PACK, 1)))
        add_param(layer, "qzeros", torch.empty(groups, n // PACK, dtype=torch.int32),
                  ParamLayout(output_dim=1, input_dim=group_dim, output_ratio=(PACK, 1),
                              input_ratio=(size, 1)))
        add_param(layer, "scales", torch.empty(groups, n, dtype=torch.float16),
                  ParamLayout(output_dim=1, input_dim=group_dim, input_ratio=(size, 1)))
        add_param(layer, "g_idx", torch.zeros(k, dtype=torch.int32),
                  ParamLayout(output_dim=None, input_dim=0, optional=not self.config.desc_act))
        layer.int4_group_size = size
        # First group this rank holds (its inputs' groups, when they follow the split).
        layer.int4_first_group = shape.input_start // size if split else 0

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        zeros = unpack_cols(layer.qzeros.data)  # [G, N]
        if self.config.zeros_minus_one:
            zeros = zeros + 1
        layer.zeros = nn.Parameter(zeros.to(torch.float16), requires_grad=False)
        del layer.qzeros
        g_idx = layer.g_idx.data.long()
        del layer.g_idx
        k = g_idx.numel()
        natural = torch.arange(k, device=g_idx.device) // layer.int4_group_size
        natural = natural + layer.int4_first_group
        if self.config.desc_act and not torch.equal(g_idx, natural):
            layer.int4_g_idx = (g_idx - layer.int4_first_group).to(torch.int32)
            if int(layer.int4_g_idx.min()) < 0 or \
                    int(layer.int4_g_idx.max()) >= layer.scales.shape[0]:
                raise ValueError("gptq g_idx names a group outside the layer's scales")
        else:
            layer.int4_g_idx = None
        self._prepare_for_kernels(layer)


class AWQConfig(QuantizationConfig):
    """An AutoAWQ checkpoint in its GEMM layout."""

    name = "awq"
    checkpoint_methods = ("awq",)

    def __init__(self, group_size: int, ignored: tuple[str, ...] = ()) -> None:
        super().__init__()
        self.group_size = group_size
        self.ignored = ignored

    @classmethod
    def from_source(cls, source: QuantizationSource) -> AWQConfig:
        config = source.hf_quant_config or {}
        bits = config.get("bits", config.get("w_bit", 4))
        if bits != 4:
            raise ValueError(f"awq checkpoint with {bits}-bit weights: Octavo runs 4-bit AWQ only")
        version = str(config.get("version", "gemm")).lower()
        if version != "gemm":
            raise ValueError(f"awq checkpoint version {version!r} is not supported: Octavo reads "
                             "the GEMM layout (version 'gemm'), not GEMV/exllama/ipex packings")
        if not config.get("zero_point", True):
            raise ValueError("awq checkpoint without zero points: not supported")
        group_size = config.get("group_size", config.get("q_group_size"))
        return cls(_group_size(group_size, "awq"),
                   tuple(config.get("modules_to_not_convert") or ()))

    def linear_method(self, prefix: str, shard_names: tuple[str, ...]) -> LinearMethod | None:
        if ignored_layer(prefix, shard_names, self.ignored):
            return None
        return AWQLinearMethod(self)

    def describe(self) -> str:
        return f"awq 4-bit (GEMM layout), group size {self.group_size}"


class AWQLinearMethod(Int4LinearMethod):
    config: AWQConfig

    def create_weights(self, layer: nn.Module, shape: LinearShape) -> None:
        n, k = shape.output_size, shape.input_size
        size, groups, split = self._groups(shape, keep_all=False)
        if k % PACK or any(s % PACK for s in shape.output_sizes):
            raise ValueError(f"awq layer of {k} inputs x {shape.output_sizes} outputs on this "
                             "rank: both must be multiples of 8")
        group_dim = 0 if split else None
        add_param(layer, "qweight", torch.empty(k, n // PACK, dtype=torch.int32),
                  ParamLayout(output_dim=1, input_dim=0, output_ratio=(PACK, 1)))
        add_param(layer, "qzeros", torch.empty(groups, n // PACK, dtype=torch.int32),
                  ParamLayout(output_dim=1, input_dim=group_dim, output_ratio=(PACK, 1),
                              input_ratio=(size, 1)))
        add_param(layer, "scales", torch.empty(groups, n, dtype=torch.float16),
                  ParamLayout(output_dim=1, input_dim=group_dim, input_ratio=(size, 1)))
        layer.int4_group_size = size

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        replace_param(layer, "qweight", pack_rows(unpack_awq(layer.qweight.data)))
        layer.zeros = nn.Parameter(unpack_awq(layer.qzeros.data).to(torch.float16),
                                   requires_grad=False)
        del layer.qzeros
        layer.int4_g_idx = None
        self._prepare_for_kernels(layer)
