"""Linear layers split over the tensor-parallel ranks (Megatron-style).

- ``ColumnParallelLinear`` splits the *output* features: each rank holds a row range of the
  weight and computes its part of the output, with no communication. Several projections of
  the same input (QKV, gate/up) are one layer of named *shards*: each rank's weight is its
  slice of every shard, one after the other, so the rank's part is one contiguous matmul.
  The checkpoint may hold the shards separately (``q_proj``, ``k_proj``, ``v_proj``) or
  fused in one tensor, the shards one after the other (Phi-3's ``qkv_proj``, ``gate_up_proj``):
  each rank then reads its slice of every shard out of the fused tensor.
- ``RowParallelLinear`` splits the *input* features: each rank holds a column range, takes the
  matching part of the input (what the column-parallel layer before it produced) and the
  partial outputs are summed over the ranks (one all-reduce); the bias is added once, after.

With one rank both are a plain ``F.linear`` over the whole weight. Every parameter's
``weight_loader`` reads only this rank's part of the checkpoint tensor.

What the weights are is the layer's ``quant_method``'s business
(``octavo.model_executor.layers.quantization``): a dense ``weight`` by default, packed integers
and scales for a quantized checkpoint. The layers own the split: each parameter's
``ParamLayout`` says which dimensions follow the output and input features, and the loaders
below cut the checkpoint tensor accordingly, whatever its format.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from octavo.distributed.parallel_state import ParallelState, divide
from octavo.model_executor.layers.quantization.base import (
    LinearMethod,
    LinearShape,
    QuantizationConfig,
    UnquantizedLinearMethod,
)
from octavo.model_executor.layers.rmsnorm import RMSNorm
from octavo.model_executor.layers.weights import (
    Loaded,
    copy_checked,
    layout_of,
    materialize,
    narrow,
    set_weight_loader,
)


def _parameter(*shape: int) -> nn.Parameter:
    """Uninitialised (the loader fills it) on the default device and dtype."""
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


def _linear_method(quant_config: QuantizationConfig | None, prefix: str,
                   shard_names: tuple[str, ...]) -> LinearMethod:
    method = None if quant_config is None else quant_config.linear_method(prefix, shard_names)
    return method or UnquantizedLinearMethod()


def _attach_loaders(layer: nn.Module, loader) -> None:
    """Give every parameter the method created the layer's loader, unless it brought its own."""
    for param in layer.parameters(recurse=False):
        if getattr(param, "weight_loader", None) is None:
            set_weight_loader(param, loader)


@dataclass(frozen=True, slots=True)
class OutputShard:
    """One projection inside a column-parallel layer, as this rank holds it."""

    # The checkpoint's name for it ("k_proj"); None for a layer of a single projection.
    name: str | None
    # This rank's rows of the checkpoint tensor: [start, start + size).
    start: int
    size: int
    # Rows of the whole projection in the checkpoint (every rank's, replicas counted once):
    # where the next shard starts in a fused checkpoint tensor.
    full_size: int


class ColumnParallelLinear(nn.Module):
    """``y = x W^T + b`` for this rank's output rows of one or more projections."""

    def __init__(self, input_size: int, shards: Sequence[OutputShard], bias: bool,
                 quant_config: QuantizationConfig | None = None, prefix: str = "") -> None:
        super().__init__()
        if not shards:
            raise ValueError("a column-parallel layer needs at least one output shard")
        self.input_size = input_size
        self.shards = tuple(shards)
        self.output_size = sum(shard.size for shard in self.shards)
        self.quant_method = _linear_method(quant_config, prefix, self.shard_names)
        self.quant_method.create_weights(self, LinearShape(
            input_size=input_size, output_sizes=tuple(s.size for s in self.shards),
            full_input_size=input_size, input_start=0, params_dtype=torch.get_default_dtype()))
        self.bias: nn.Parameter | None = None
        if bias:
            self.bias = _parameter(self.output_size)
        _attach_loaders(self, self._load)
        # Batched LoRA adapters (an octavo.lora.layers.LoRALinear, set with --enable-lora).
        self.lora: nn.Module | None = None

    @property
    def shard_names(self) -> tuple[str, ...]:
        """Names of the projections merged here (empty for a single unnamed one)."""
        return tuple(s.name for s in self.shards if s.name is not None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [num_tokens, output_size (local)]
        out = self.quant_method.apply(self, x, self.bias)
        if self.lora is not None:
            self.lora.add_to(x, out)
        return out

    def forward_add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor,
                             norm: nn.Module) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(forward(h), s)`` for ``h, s = norm(x, residual)`` with the norm inside the
        method's kernel (``LinearMethod.apply_add_rms_norm``), or ``None`` where it has none
        for these operands, ``norm`` is not a plain ``RMSNorm``, or LoRA adapters need the
        normed input: the caller runs the norm and ``forward``."""
        if self.lora is not None or type(norm) is not RMSNorm:
            return None
        return self.quant_method.apply_add_rms_norm(self, x, residual, norm.weight, norm.eps,
                                                    self.bias)

    def shard_location(self, shard_name: str | None) -> tuple[int, int, OutputShard]:
        """(index, first local output feature, shard) of the projection ``shard_name``."""
        offset = 0
        for index, shard in enumerate(self.shards):
            if shard.name == shard_name:
                return index, offset, shard
            offset += shard.size
        raise ValueError(f"this layer has no shard {shard_name!r} (it has {self.shard_names})")

    def _load(self, param: nn.Parameter, loaded: Loaded, shard_name: str | None) -> None:
        if shard_name is None and self.shard_names:
            self._load_fused(param, loaded)
            return
        index, offset, shard = self.shard_location(shard_name)
        layout = layout_of(param)
        what = f"{shard_name or ''} rows {shard.start}..{shard.start + shard.size}"
        with torch.no_grad():
            if layout.per_shard:  # one value per projection (a per-tensor scale)
                copy_checked(param.data[index].reshape(1), materialize(loaded).reshape(-1),
                             f"{shard_name or ''} (one value per projection)")
            elif layout.output_dim is None:  # the same for every projection (GPTQ's g_idx)
                copy_checked(param.data, materialize(loaded), shard_name or "")
            else:
                dim = layout.output_dim
                dest = param.data.narrow(dim, layout.to_elements(offset, "output", what),
                                         layout.to_elements(shard.size, "output", what))
                source = narrow(loaded, dim, layout.to_elements(shard.start, "output", what),
                                layout.to_elements(shard.size, "output", what))
                copy_checked(dest, source, what)

    def _load_fused(self, param: nn.Parameter, loaded: Loaded) -> None:
        """Every shard's slice from one checkpoint tensor holding the shards in order (along
        the parameter's output dimension; a per-projection scale is the fused tensor's one
        value, copied to every shard)."""
        layout = layout_of(param)
        with torch.no_grad():
            if layout.per_shard:
                value = materialize(loaded).reshape(-1)
                for index, shard in enumerate(self.shards):
                    copy_checked(param.data[index].reshape(1), value,
                                 f"{shard.name} (one value for the fused projections)")
                return
            if layout.output_dim is None:
                copy_checked(param.data, materialize(loaded), "fused " + "/".join(self.shard_names))
                return
            dim = layout.output_dim
            names = ", ".join(self.shard_names)
            sizes = [layout.to_elements(s.full_size, "output", names) for s in self.shards]
            if loaded.shape[dim] != sum(sizes):
                raise ValueError(
                    f"fused checkpoint weight has {loaded.shape[dim]} rows, expected "
                    f"{sum(sizes)} ({' + '.join(map(str, sizes))} for {names})")
            offset = fused_offset = 0
            for shard in self.shards:
                what = f"{shard.name} rows {shard.start}..{shard.start + shard.size}"
                size = layout.to_elements(shard.size, "output", what)
                dest = param.data.narrow(dim, layout.to_elements(offset, "output", what), size)
                source = narrow(loaded, dim, layout.to_elements(fused_offset + shard.start,
                                                                "output", what), size)
                copy_checked(dest, source, what)
                offset += shard.size
                fused_offset += shard.full_size

    def extra_repr(self) -> str:
        return f"in={self.input_size}, out={self.output_size}, shards={self.shard_names or None}"


class ReplicatedLinear(nn.Module):
    """``y = x W^T`` with the whole weight on every rank (small layers such as MoE routers)."""

    def __init__(self, input_size: int, output_size: int) -> None:
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        self.weight = _parameter(output_size, input_size)  # loaded whole (load_whole)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [num_tokens, output_size]
        return F.linear(x, self.weight)

    def extra_repr(self) -> str:
        return f"in={self.input_size}, out={self.output_size}"


def column_parallel(input_size: int, output_size: int, bias: bool,
                    parallel: ParallelState, name: str | None = None,
                    quant_config: QuantizationConfig | None = None,
                    prefix: str = "") -> ColumnParallelLinear:
    """One projection whose output features are split evenly over the TP ranks."""
    local = divide(output_size, parallel.tp_size, f"output size of {name or 'the layer'}")
    return ColumnParallelLinear(
        input_size, [OutputShard(name, parallel.tp_rank * local, local, output_size)], bias,
        quant_config, prefix)


def merged_column_parallel(input_size: int, output_sizes: Sequence[int], names: Sequence[str],
                           bias: bool, parallel: ParallelState,
                           quant_config: QuantizationConfig | None = None,
                           prefix: str = "") -> ColumnParallelLinear:
    """Several projections of the same input (e.g. gate and up), each split evenly."""
    shards = []
    for size, name in zip(output_sizes, names, strict=True):
        local = divide(size, parallel.tp_size, f"output size of {name}")
        shards.append(OutputShard(name, parallel.tp_rank * local, local, size))
    return ColumnParallelLinear(input_size, shards, bias, quant_config, prefix)


def local_kv_heads(num_kv_heads: int, tp_size: int) -> int:
    """KV heads each rank holds: an even split, or one replicated head when there are fewer
    KV heads than ranks (every ``tp_size // num_kv_heads`` ranks share a head)."""
    if num_kv_heads >= tp_size:
        return divide(num_kv_heads, tp_size, "the number of KV heads")
    divide(tp_size, num_kv_heads, "tensor_parallel_size, with fewer KV heads than ranks,")
    return 1


def qkv_parallel(hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 bias: bool, parallel: ParallelState,
                 quant_config: QuantizationConfig | None = None,
                 prefix: str = "") -> ColumnParallelLinear:
    """The merged Q/K/V projection: query heads split over the ranks; KV heads split, or
    replicated when there are fewer KV heads than ranks."""
    tp, rank = parallel.tp_size, parallel.tp_rank
    q_heads = divide(num_heads, tp, "the number of attention heads")
    kv_heads = local_kv_heads(num_kv_heads, tp)
    first_kv = rank * kv_heads if num_kv_heads >= tp else rank * num_kv_heads // tp
    return ColumnParallelLinear(hidden_size, [
        OutputShard("q_proj", rank * q_heads * head_dim, q_heads * head_dim, num_heads * head_dim),
        OutputShard("k_proj", first_kv * head_dim, kv_heads * head_dim, num_kv_heads * head_dim),
        OutputShard("v_proj", first_kv * head_dim, kv_heads * head_dim, num_kv_heads * head_dim),
    ], bias, quant_config, prefix)


class RowParallelLinear(nn.Module):
    """``y = sum over ranks (x_r W_r^T) + b``: the input features are split over the ranks.

    With ``reduce_results=False`` (no bias) a split layer returns this rank's partial product
    and the caller all-reduces it, e.g. once for the sum of several such layers' outputs.
    """

    def __init__(self, input_size: int, output_size: int, bias: bool,
                 parallel: ParallelState, reduce_results: bool = True,
                 quant_config: QuantizationConfig | None = None,
                 prefix: str = "") -> None:
        super().__init__()
        if bias and not reduce_results:
            raise ValueError("a row-parallel layer that leaves the reduction to its caller "
                             "cannot add a bias")
        self.parallel = parallel
        self.reduce_results = reduce_results
        self.input_size = input_size
        self.local_input_size = divide(input_size, parallel.tp_size, "input size of the layer")
        self.input_start = parallel.tp_rank * self.local_input_size
        self.output_size = output_size
        self.quant_method = _linear_method(quant_config, prefix, ())
        self.quant_method.create_weights(self, LinearShape(
            input_size=self.local_input_size, output_sizes=(output_size,),
            full_input_size=input_size, input_start=self.input_start,
            params_dtype=torch.get_default_dtype()))
        self.bias: nn.Parameter | None = None
        if bias:
            self.bias = _parameter(output_size)
        _attach_loaders(self, self._load)
        # Batched LoRA adapters (an octavo.lora.layers.LoRALinear, set with --enable-lora):
        # added to this rank's partial product, before the all-reduce.
        self.lora: nn.Module | None = None

    @property
    def shard_names(self) -> tuple[str, ...]:
        return ()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [num_tokens, output_size]
        single = self.parallel.tp_size == 1
        # One rank: the bias fused, as nn.Linear does; several: added once, after the sum.
        out = self.quant_method.apply(self, x, self.bias if single else None)
        if self.lora is not None:
            self.lora.add_to(x, out)
        if single or not self.reduce_results:  # (else this rank's part; the caller reduces)
            return out
        out = self.parallel.all_reduce(out)
        return out if self.bias is None else out + self.bias

    def _load(self, param: nn.Parameter, loaded: Loaded, shard_name: str | None) -> None:
        assert shard_name is None, "a row-parallel layer has no shards"
        layout = layout_of(param)
        start, size = self.input_start, self.local_input_size
        what = f"columns {start}..{start + size}"
        with torch.no_grad():
            if layout.input_dim is None:  # replicated: the bias, per-output scales
                copy_checked(param.data, materialize(loaded).reshape(param.shape)
                             if layout.per_shard else materialize(loaded), "")
                return
            dim = layout.input_dim
            copy_checked(param.data, narrow(loaded, dim, layout.to_elements(start, "input", what),
                                            layout.to_elements(size, "input", what)), what)

    def extra_repr(self) -> str:
        return f"in={self.input_size} (local {self.local_input_size}), out={self.output_size}"
