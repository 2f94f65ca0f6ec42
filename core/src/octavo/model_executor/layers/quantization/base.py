"""The contract of a quantization method: a config read from the checkpoint, and the linear
method it gives each linear layer (its parameters, their loaders, its matmul).

A ``QuantizationConfig`` is built once per worker from a ``QuantizationSource`` (the
checkpoint's ``quantization_config``, or the GGUF file). Each ``ColumnParallelLinear`` /
``RowParallelLinear`` asks it for a ``LinearMethod`` by its Hugging Face name; the method

1. ``create_weights(layer, shape)``: registers the parameters the checkpoint's tensors are
   copied into (on the default device), each with a ``ParamLayout``
   (``octavo.model_executor.layers.weights``) so the layer's own loader cuts every tensor into
   this rank's part and a merged projection's shard; or with its own ``weight_loader``;
2. ``process_weights_after_loading(layer)``: once every tensor is in, converts them to what its
   kernels read (repacking, folding scales);
3. ``apply(layer, x, bias)``: ``x @ W^T (+ bias)`` for ``x`` ``[num_tokens, input_size]`` in the
   model dtype, returning ``[num_tokens, output_size]`` in the same dtype.

Kernels a backend provides for a method (``octavo_quant_kernels``) reach the config as
``kernels``; a method uses them where they exist and its own torch code where not.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import nn

from octavo.kernels.dense import dense_linear
from octavo.model_executor.layers.weights import DENSE_LAYOUT, ParamLayout, set_layout


@dataclass(frozen=True, slots=True)
class LinearShape:
    """One linear layer as this rank holds it: what a method lays its weights out for."""

    # Input features this rank multiplies (its part of them under row parallelism).
    input_size: int
    # Output features of each merged projection on this rank, in order (one for a plain layer).
    output_sizes: tuple[int, ...]
    # Input features of the whole layer, over every rank.
    full_input_size: int
    # First input feature of this rank's part (0 unless row-parallel and rank > 0).
    input_start: int
    # The model dtype: activations, dense weights, biases.
    params_dtype: torch.dtype

    @property
    def output_size(self) -> int:
        return sum(self.output_sizes)

    @property
    def input_is_split(self) -> bool:
        """Whether the layer's input features are split over ranks (row-parallel, tp > 1)."""
        return self.input_size != self.full_input_size


@dataclass(frozen=True, slots=True)
class QuantizationSource:
    """Where a method reads its settings from."""

    # The checkpoint's ``quantization_config`` (config.json), None when it has none.
    hf_quant_config: dict[str, Any] | None
    # The GGUF file of a GGUF model, else None.
    gguf_file: Path | None = None


class LinearMethod(ABC):
    """How one linear layer stores and multiplies its weights (see the module docstring)."""

    #: Checkpoint parameter name -> the layer's parameter that takes it (e.g. FineGrainedFP8's
    #: ``weight_scale_inv`` -> ``weight_scale``); used by ``load_hf_weights``.
    checkpoint_aliases: ClassVar[dict[str, str]] = {}

    @abstractmethod
    def create_weights(self, layer: nn.Module, shape: LinearShape) -> None:
        """Register ``layer``'s weight parameters (not the bias) for ``shape``."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Turn the loaded tensors into what ``apply`` reads (default: nothing to do)."""

    @abstractmethod
    def apply(self, layer: nn.Module, x: torch.Tensor,
              bias: torch.Tensor | None) -> torch.Tensor:
        """``x @ W^T + bias``: ``[num_tokens, input_size]`` -> ``[num_tokens, output_size]``,
        in ``x``'s dtype."""

    def apply_add_rms_norm(self, layer: nn.Module, x: torch.Tensor, residual: torch.Tensor,
                           norm_weight: torch.Tensor, eps: float,
                           bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(apply(layer, rms_norm(x + residual) * norm_weight, bias), x + residual)`` in one
        kernel, where the method has one for these operands (``RMSNorm(x, residual)`` then
        the layer, as a decoder layer runs them); ``None`` (the default): the caller runs the
        norm, then ``apply``."""
        return None

    def fill_dummy_weights(self, layer: nn.Module, generator: torch.Generator) -> None:
        """Random weights of the right format (``load_format="dummy"``, benchmarks)."""
        raise ValueError(f"{type(self).__name__} cannot make dummy weights; load a checkpoint")


class QuantizationConfig(ABC):
    """A quantization method's settings for one model, and the factory of its linear methods.

    Subclasses are registered by name through ``octavo_register_quantization_methods``.
    """

    #: The ``--quantization`` name.
    name: ClassVar[str]
    #: ``quant_method`` values of a checkpoint's ``quantization_config`` this method reads.
    checkpoint_methods: ClassVar[tuple[str, ...]] = ()
    #: Whether it can quantize a dense (bf16/fp16/fp32) checkpoint while loading it.
    quantizes_dense_checkpoints: ClassVar[bool] = False
    #: Whether it reads GGUF files.
    reads_gguf: ClassVar[bool] = False

    def __init__(self) -> None:
        # What the backend provides for this method (octavo_quant_kernels), or None.
        self.kernels: Any = None

    @classmethod
    @abstractmethod
    def from_source(cls, source: QuantizationSource) -> QuantizationConfig:
        """Read the settings; ``ValueError`` naming the setting for a variant it cannot run."""

    @abstractmethod
    def linear_method(self, prefix: str, shard_names: tuple[str, ...]) -> LinearMethod | None:
        """The method for the linear layer named ``prefix`` (HF name, e.g.
        ``model.layers.0.mlp.gate_up_proj``) merging the projections ``shard_names`` (empty
        for a single one); ``None`` to leave the layer unquantized (an ignored module)."""

    def embedding_method(self, prefix: str, vocab_rows: int,
                         hidden_size: int) -> EmbeddingMethod | None:
        """The method for the token embedding / LM head named ``prefix`` (``model.embed_tokens``,
        ``lm_head``) holding ``vocab_rows`` rows of ``hidden_size`` on one rank, called once the
        model is built and before its weights load; ``None`` (the default) keeps it dense."""
        return None

    def describe(self) -> str:
        """One line for the start-up log."""
        return self.name


class EmbeddingMethod(LinearMethod):
    """How a token embedding (and, tied or not, the LM head) stores its table:
    ``create_weights`` replaces the layer's ``weight``, ``apply`` computes the logits
    ``x @ W^T`` and ``embedding`` looks rows up, ``[...]`` ids -> ``[..., hidden_size]`` in the
    model dtype."""

    @abstractmethod
    def embedding(self, layer: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
        """The rows of ``input_ids``."""


def add_param(layer: nn.Module, name: str, tensor: torch.Tensor,
              layout: ParamLayout = DENSE_LAYOUT) -> nn.Parameter:
    """Register ``tensor`` as the frozen parameter ``name`` of ``layer`` with ``layout``."""
    param = nn.Parameter(tensor, requires_grad=False)
    set_layout(param, layout)
    layer.register_parameter(name, param)
    return param


def replace_param(layer: nn.Module, name: str, tensor: torch.Tensor) -> None:
    """Swap ``layer.name`` for ``tensor`` after loading (a repacked or converted weight)."""
    delattr(layer, name)
    layer.register_parameter(name, nn.Parameter(tensor, requires_grad=False))


class UnquantizedLinearMethod(LinearMethod):
    """A dense weight ``[output_size, input_size]`` in the model dtype; ``F.linear``, or a
    one-row GEMV at batch 1 where it is faster (``octavo.kernels.dense``)."""

    def create_weights(self, layer: nn.Module, shape: LinearShape) -> None:
        add_param(layer, "weight", torch.empty(shape.output_size, shape.input_size,
                                               dtype=shape.params_dtype))

    def apply(self, layer: nn.Module, x: torch.Tensor,
              bias: torch.Tensor | None) -> torch.Tensor:
        return dense_linear(x, layer.weight, bias)
