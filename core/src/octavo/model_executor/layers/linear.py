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
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from octavo.distributed.parallel_state import ParallelState, divide
from octavo.model_executor.layers.weights import (
    Loaded,
    copy_checked,
    load_whole,
    narrow,
    set_weight_loader,
)


def _parameter(*shape: int) -> nn.Parameter:
    """Uninitialised (the loader fills it) on the default device and dtype."""
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


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

    def __init__(self, input_size: int, shards: Sequence[OutputShard], bias: bool) -> None:
        super().__init__()
        if not shards:
            raise ValueError("a column-parallel layer needs at least one output shard")
        self.input_size = input_size
        self.shards = tuple(shards)
        self.output_size = sum(shard.size for shard in self.shards)
        self.weight = _parameter(self.output_size, input_size)
        set_weight_loader(self.weight, self._load)
        self.bias: nn.Parameter | None = None
        if bias:
            self.bias = _parameter(self.output_size)
            set_weight_loader(self.bias, self._load)

    @property
    def shard_names(self) -> tuple[str, ...]:
        """Names of the projections merged here (empty for a single unnamed one)."""
        return tuple(s.name for s in self.shards if s.name is not None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [num_tokens, output_size (local)]
        return F.linear(x, self.weight, self.bias)

    def _load(self, param: nn.Parameter, loaded: Loaded, shard_name: str | None) -> None:
        if shard_name is None and self.shard_names:
            self._load_fused(param, loaded)
            return
        offset = 0
        for shard in self.shards:
            if shard.name == shard_name:
                break
            offset += shard.size
        else:
            raise ValueError(f"this layer has no shard {shard_name!r} (it has {self.shard_names})")
        with torch.no_grad():
            dest = param.data.narrow(0, offset, shard.size)
            copy_checked(dest, narrow(loaded, 0, shard.start, shard.size),
                         f"{shard_name or ''} rows {shard.start}..{shard.start + shard.size}")

    def _load_fused(self, param: nn.Parameter, loaded: Loaded) -> None:
        """Every shard's slice from one checkpoint tensor holding the shards in order."""
        expected = sum(shard.full_size for shard in self.shards)
        if loaded.shape[0] != expected:
            raise ValueError(f"fused checkpoint weight has {loaded.shape[0]} rows, expected "
                             f"{expected} ({' + '.join(str(s.full_size) for s in self.shards)} "
                             f"for {', '.join(self.shard_names)})")
        offset = fused_offset = 0
        with torch.no_grad():
            for shard in self.shards:
                dest = param.data.narrow(0, offset, shard.size)
                copy_checked(dest, narrow(loaded, 0, fused_offset + shard.start, shard.size),
                             f"{shard.name} rows {shard.start}..{shard.start + shard.size}")
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
                    parallel: ParallelState, name: str | None = None) -> ColumnParallelLinear:
    """One projection whose output features are split evenly over the TP ranks."""
    local = divide(output_size, parallel.tp_size, f"output size of {name or 'the layer'}")
    return ColumnParallelLinear(
        input_size, [OutputShard(name, parallel.tp_rank * local, local, output_size)], bias)


def merged_column_parallel(input_size: int, output_sizes: Sequence[int], names: Sequence[str],
                           bias: bool, parallel: ParallelState) -> ColumnParallelLinear:
    """Several projections of the same input (e.g. gate and up), each split evenly."""
    shards = []
    for size, name in zip(output_sizes, names, strict=True):
        local = divide(size, parallel.tp_size, f"output size of {name}")
        shards.append(OutputShard(name, parallel.tp_rank * local, local, size))
    return ColumnParallelLinear(input_size, shards, bias)


def local_kv_heads(num_kv_heads: int, tp_size: int) -> int:
    """KV heads each rank holds: an even split, or one replicated head when there are fewer
    KV heads than ranks (every ``tp_size // num_kv_heads`` ranks share a head)."""
    if num_kv_heads >= tp_size:
        return divide(num_kv_heads, tp_size, "the number of KV heads")
    divide(tp_size, num_kv_heads, "tensor_parallel_size, with fewer KV heads than ranks,")
    return 1


def qkv_parallel(hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 bias: bool, parallel: ParallelState) -> ColumnParallelLinear:
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
    ], bias)


class RowParallelLinear(nn.Module):
    """``y = sum over ranks (x_r W_r^T) + b``: the input features are split over the ranks.

    With ``reduce_results=False`` (no bias) a split layer returns this rank's partial product
    and the caller all-reduces it, e.g. once for the sum of several such layers' outputs.
    """

    def __init__(self, input_size: int, output_size: int, bias: bool,
                 parallel: ParallelState, reduce_results: bool = True) -> None:
        super().__init__()
        if bias and not reduce_results:
            raise ValueError("a row-parallel layer that leaves the reduction to its caller "
                             "cannot add a bias")
        self.parallel = parallel
        self.reduce_results = reduce_results
        self.input_size = input_size
        self.local_input_size = divide(input_size, parallel.tp_size, "input size of the layer")
        self.output_size = output_size
        self.weight = _parameter(output_size, self.local_input_size)
        set_weight_loader(self.weight, self._load_weight)
        self.bias: nn.Parameter | None = None
        if bias:
            self.bias = _parameter(output_size)
            set_weight_loader(self.bias, load_whole)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [num_tokens, output_size]
        if self.parallel.tp_size == 1:
            return F.linear(x, self.weight, self.bias)  # the bias fused, as nn.Linear does
        if not self.reduce_results:
            return F.linear(x, self.weight)  # this rank's part; the caller all-reduces
        out = self.parallel.all_reduce(F.linear(x, self.weight))
        return out if self.bias is None else out + self.bias

    def _load_weight(self, param: nn.Parameter, loaded: Loaded, shard_name: str | None) -> None:
        assert shard_name is None, "a row-parallel layer has no shards"
        start = self.parallel.tp_rank * self.local_input_size
        with torch.no_grad():
            copy_checked(param.data, narrow(loaded, 1, start, self.local_input_size),
                         f"columns {start}..{start + self.local_input_size}")

    def extra_repr(self) -> str:
        return f"in={self.input_size} (local {self.local_input_size}), out={self.output_size}"
