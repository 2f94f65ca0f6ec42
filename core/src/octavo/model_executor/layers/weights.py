"""How checkpoint tensors reach parameters: one ``weight_loader`` per parameter.

Every parameter of a model built from these layers carries a ``weight_loader(param, loaded,
shard)`` that copies the part of a checkpoint tensor this rank owns into it: the whole tensor
for replicated parameters (norms), a row range for column-parallel ones, a column range for
row-parallel ones, and for merged projections (QKV, gate/up) the range of one named shard.

A loaded tensor is a ``torch.Tensor`` or a ``CheckpointTensor``: a view of a tensor still on
disk whose ``narrow`` reads only the asked-for range (safetensors slices), so a rank of a split
model never holds more than its own part of a weight.

A parameter of a linear layer may carry a ``ParamLayout`` (``set_layout``): how its dimensions
map to the layer's input and output features. Quantized formats pack several features into one
element (eight 4-bit values in an int32, a GGUF block of 32 values in 18 bytes) or hold one
scale per group of features; the layout lets the linear layers' loaders cut any such tensor
into a rank's part and a merged projection's shard without knowing the format.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
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


@dataclass(frozen=True, slots=True)
class ParamLayout:
    """How one parameter of a linear layer lies along the layer's features.

    ``features_per``/``elements_per`` say that ``features`` features take ``elements`` entries
    along the dimension: ``(1, 1)`` for a dense weight, ``(8, 1)`` for eight 4-bit values per
    int32, ``(128, 1)`` for one scale per group of 128 inputs, ``(32, 18)`` for a GGUF Q4_0 row
    (32 values in 18 bytes). A loader converts a feature range with ``to_elements`` and refuses
    a range that does not fall on a whole element (a split that cuts a pack or a group).
    """

    # Dimension indexed by output features (None: the parameter does not vary along them).
    output_dim: int | None = 0
    # Dimension indexed by input features (None: it does not vary along them, or is kept whole).
    input_dim: int | None = 1
    # (features, elements) along output_dim.
    output_ratio: tuple[int, int] = (1, 1)
    # (features, elements) along input_dim.
    input_ratio: tuple[int, int] = (1, 1)
    # One entry per merged shard along dim 0 (a per-tensor scale of each projection).
    per_shard: bool = False
    # The checkpoint may lack it (an optional tensor such as GPTQ's g_idx without act-order).
    optional: bool = False

    def to_elements(self, features: int, along: str, what: str) -> int:
        """``features`` features along ``along`` ("output"/"input") as a count of entries."""
        num, den = self.output_ratio if along == "output" else self.input_ratio
        if (features * den) % num:
            raise ValueError(
                f"{what}: {features} {along} features do not fall on whole entries of this "
                f"quantized tensor ({num} features per {den} entries); choose a "
                "tensor_parallel_size that splits the layer on its packing or group size")
        return features * den // num


DENSE_LAYOUT = ParamLayout()
# A 1-D parameter along the outputs (a bias).
VECTOR_LAYOUT = ParamLayout(output_dim=0, input_dim=None)


def set_layout(param: nn.Parameter, layout: ParamLayout) -> None:
    param.param_layout = layout  # type: ignore[attr-defined]


def layout_of(param: nn.Parameter) -> ParamLayout:
    """A parameter's layout (dense for parameters that declare none)."""
    layout = getattr(param, "param_layout", None)
    if layout is not None:
        return layout
    return DENSE_LAYOUT if param.dim() > 1 else VECTOR_LAYOUT
