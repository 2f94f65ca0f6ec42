"""How checkpoint tensors reach parameters: one ``weight_loader`` per parameter.

Every parameter of a model built from these layers carries a ``weight_loader(param, loaded,
shard)`` that copies the part of a checkpoint tensor this rank owns into it: the whole tensor
for replicated parameters (norms), a row range for column-parallel ones, a column range for
row-parallel ones, and for merged projections (QKV, gate/up) the range of one named shard.

A loaded tensor is a ``torch.Tensor`` or a ``CheckpointTensor``: a view of a tensor still on
disk whose ``narrow`` reads only the asked-for range (safetensors slices), so a rank of a split
model never holds more than its own part of a weight.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, runtime_checkable

import torch
from torch import nn


@runtime_checkable
class CheckpointTensor(Protocol):
    """A checkpoint tensor not read yet."""

    @property
    def shape(self) -> tuple[int, ...]: ...

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        """Read ``[start, start + length)`` along ``dim`` (and everything along the others)."""
        ...

    def load(self) -> torch.Tensor:
        """Read the whole tensor."""
        ...


Loaded = torch.Tensor | CheckpointTensor
# (parameter, checkpoint tensor, shard name or None) -> None
WeightLoader = Callable[[nn.Parameter, Loaded, str | None], None]


def materialize(loaded: Loaded) -> torch.Tensor:
    """The whole of ``loaded`` as a tensor."""
    return loaded if isinstance(loaded, torch.Tensor) else loaded.load()


def narrow(loaded: Loaded, dim: int, start: int, length: int) -> torch.Tensor:
    """``loaded[..., start:start + length, ...]`` along ``dim``, read from disk if lazy."""
    if start == 0 and length == loaded.shape[dim]:
        return materialize(loaded)
    return loaded.narrow(dim, start, length)


def copy_checked(dest: torch.Tensor, source: torch.Tensor, what: str) -> None:
    """``dest.copy_(source)`` after checking the shapes agree (cast to dest's dtype/device)."""
    if tuple(dest.shape) != tuple(source.shape):
        raise ValueError(
            f"checkpoint weight {what} has shape {tuple(source.shape)}, expected {tuple(dest.shape)}"
        )
    dest.copy_(source)


def load_whole(param: nn.Parameter, loaded: Loaded, shard: str | None) -> None:
    """The loader of a replicated parameter: copy the whole checkpoint tensor."""
    assert shard is None, f"a replicated parameter has no shard {shard!r}"
    with torch.no_grad():
        copy_checked(param.data, materialize(loaded), "")


def set_weight_loader(param: nn.Parameter, loader: WeightLoader) -> None:
    param.weight_loader = loader  # type: ignore[attr-defined]


def weight_loader_of(param: nn.Parameter) -> WeightLoader:
    """A parameter's loader (``load_whole`` for parameters that declare none)."""
    return getattr(param, "weight_loader", load_whole)
