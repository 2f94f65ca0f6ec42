"""``gguf``: llama.cpp weights kept in their quantized blocks, dequantized inside the matmul.

A linear layer whose GGUF tensors are of a type in ``octavo.kernels.gguf.GGUF_BLOCKS`` (Q4_0,
Q4_1, Q8_0, Q4_K, Q6_K) holds them as one uint8 buffer ``weight``: each merged projection's
rows (``[rows, bytes_per_row]`` of its type) one after the other, so projections of different
types (a Q4_K_M file's Q6_K ``attn_v`` beside Q4_K ``attn_q``) share a layer. The matmul is
``octavo.kernels.gguf.gguf_linear``: the backend's kernel when it provides one
(``octavo_quant_kernels`` -> ``gguf_matmul``), the Triton kernel on GPUs, else torch
dequantizing the weight for the product only; projections of one type run as one matmul.

Layers whose tensors are stored as floats (F32/F16/BF16) are dense; a layer of another
quantized type (Q5_K, IQ4_XS, ...) is refused: ``--quantization none`` dequantizes the whole
file while loading instead.

The token embedding and the LM head (tied or not) stay in their blocks too when their type is
one of those and the model runs on one tensor-parallel rank (``GGUFEmbeddingMethod``): a lookup
dequantizes only the rows it reads (``gguf_dequantize`` of the backend's kernels, else torch),
the logits are ``gguf_linear``. Otherwise they are dequantized while loading.
"""

from __future__ import annotations

import torch
from torch import nn

from octavo.kernels.gguf import GGUF_BLOCKS, bytes_per_row, dequantize_rows, gguf_linear
from octavo.model_executor.layers.quantization.base import (
    EmbeddingMethod,
    LinearMethod,
    LinearShape,
    QuantizationConfig,
    QuantizationSource,
    add_param,
)
from octavo.model_executor.layers.weights import Loaded, ParamLayout, copy_checked

_FLOAT_TYPES = ("F32", "F16", "BF16")


class GGUFConfig(QuantizationConfig):
    """The storage type of each weight of one GGUF file."""

    name = "gguf"
    reads_gguf = True

    def __init__(self, weight_types: dict[str, str]) -> None:
        super().__init__()
        # HF weight name -> GGUF type name.
        self.weight_types = weight_types

    @classmethod
    def from_source(cls, source: QuantizationSource) -> GGUFConfig:
        if source.gguf_file is None:
            raise ValueError("the gguf quantization method reads .gguf files; this model is not "
                             "one")
        from octavo.model_executor.loader.gguf_loader import gguf_weight_types

        return cls(gguf_weight_types(source.gguf_file))

    def linear_method(self, prefix: str, shard_names: tuple[str, ...]) -> LinearMethod | None:
        parent = prefix.rpartition(".")[0]
        names = [f"{parent}.{s}.weight" if parent else f"{s}.weight" for s in shard_names]
        names = names or [f"{prefix}.weight"]
        types = [self.weight_types.get(name) for name in names]
        if any(t is None for t in types):  # not in the file: the loader will name it
            return None
        if all(t in _FLOAT_TYPES for t in types):
            return None
        unsupported = sorted({t for t in types if t not in GGUF_BLOCKS})
        if unsupported:
            raise ValueError(
                f"GGUF weights {', '.join(names)} are stored as {', '.join(unsupported)}, which "
                f"Octavo does not keep quantized (it keeps {', '.join(GGUF_BLOCKS)}); run with "
                "--quantization none to dequantize the file while loading")
        return GGUFLinearMethod(self, tuple(types))

    def embedding_method(self, prefix: str, vocab_rows: int,
                         hidden_size: int) -> EmbeddingMethod | None:
        qtype = self.weight_types.get(f"{prefix}.weight")
        if qtype is None and prefix == "lm_head":  # tied: the head is the embedding's table
            qtype = self.weight_types.get("model.embed_tokens.weight")
        if qtype not in GGUF_BLOCKS:
            return None
        bytes_per_row(qtype, hidden_size)  # whole blocks per row, else ValueError
        return GGUFEmbeddingMethod(self, qtype)

    def describe(self) -> str:
        counts: dict[str, int] = {}
        for qtype in self.weight_types.values():
            counts[qtype] = counts.get(qtype, 0) + 1
        listed = ", ".join(f"{n} {t}" for t, n in sorted(counts.items()))
        return f"gguf blocks kept quantized ({listed} tensors)"


class GGUFLinearMethod(LinearMethod):
    """One uint8 buffer ``weight`` holding every projection's rows in its own GGUF type."""

    def __init__(self, config: GGUFConfig, qtypes: tuple[str, ...]) -> None:
        self.config = config
        # GGUF type of each merged projection, in order.
        self.qtypes = qtypes

    def create_weights(self, layer: nn.Module, shape: LinearShape) -> None:
        k = shape.input_size
        # (qtype, rows, bytes per row, first byte) of each projection in the buffer.
        parts = []
        offset = 0
        for qtype, rows in zip(self.qtypes, shape.output_sizes, strict=True):
            row_bytes = bytes_per_row(qtype, k)
            if shape.input_is_split:
                bytes_per_row(qtype, shape.input_start)  # the split must fall on a block
            parts.append((qtype, rows, row_bytes, offset))
            offset += rows * row_bytes
        layer.gguf_parts = tuple(parts)
        layer.gguf_input_start = shape.input_start
        layer.gguf_input_size = k
        layer.gguf_full_input_size = shape.full_input_size
        param = add_param(layer, "weight", torch.empty(offset, dtype=torch.uint8),
                          ParamLayout(output_dim=None, input_dim=None))
        param.weight_loader = self._loader(layer)  # type: ignore[attr-defined]

    def _loader(self, layer: nn.Module):
        def load(param: nn.Parameter, loaded: Loaded, shard_name: str | None) -> None:
            from octavo.model_executor.loader.gguf_loader import GGUFBlocks

            index, row_start = 0, 0  # a row-parallel layer: one projection, every row
            if hasattr(layer, "shard_location"):  # column-parallel: this shard's rows
                index, _, shard = layer.shard_location(shard_name)
                row_start = shard.start
            qtype, num_rows, row_bytes, offset = layer.gguf_parts[index]
            if not isinstance(loaded, GGUFBlocks) or loaded.qtype != qtype:
                found = loaded.qtype if isinstance(loaded, GGUFBlocks) else "dense"
                raise ValueError(f"expected {qtype} blocks, got a {found} tensor")
            blocks = loaded.blocks().narrow(0, row_start, num_rows)
            if layer.gguf_input_size != layer.gguf_full_input_size:  # this rank's columns
                blocks = blocks.narrow(1, bytes_per_row(qtype, layer.gguf_input_start), row_bytes)
            with torch.no_grad():
                dest = param.data.narrow(0, offset, num_rows * row_bytes).view(num_rows, row_bytes)
                copy_checked(dest, blocks, f"{shard_name or ''} {qtype} rows")
        return load

    def _views(self, layer: nn.Module) -> list[tuple[str, torch.Tensor]]:
        """(qtype, uint8 [rows, bytes_per_row]) runs of consecutive projections of one type."""
        runs: list[tuple[str, int, int, int]] = []  # qtype, rows, row_bytes, offset
        for qtype, rows, row_bytes, offset in layer.gguf_parts:
            if runs and runs[-1][0] == qtype:
                previous = runs[-1]
                runs[-1] = (qtype, previous[1] + rows, row_bytes, previous[3])
            else:
                runs.append((qtype, rows, row_bytes, offset))
        return [(qtype, layer.weight.narrow(0, offset, rows * row_bytes).view(rows, row_bytes))
                for qtype, rows, row_bytes, offset in runs]

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        # The per-type runs are fixed once loaded: made once, not at every step. A backend
        # kernel that can check a weight once (``gguf_matmul_bound``) gets each run bound to
        # it here, so a step's matmul is one call without the per-call checks.
        layer.gguf_runs = self._views(layer)
        bind = getattr(self.config.kernels, "gguf_matmul_bound", None)
        layer.gguf_matmuls = None if bind is None else tuple(
            bind(blocks, qtype, layer.gguf_input_size) for qtype, blocks in layer.gguf_runs)

    def apply(self, layer: nn.Module, x: torch.Tensor,
              bias: torch.Tensor | None) -> torch.Tensor:
        matmuls = getattr(layer, "gguf_matmuls", None)
        if matmuls is not None:
            outs = [matmul(x) for matmul in matmuls]
        else:
            k = layer.gguf_input_size
            runs = getattr(layer, "gguf_runs", None) or self._views(layer)
            outs = [gguf_linear(x, blocks, qtype, k, self.config.kernels)
                    for qtype, blocks in runs]
        out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)
        return out if bias is None else out + bias

    def dequantized_weight(self, layer: nn.Module, dtype: torch.dtype) -> torch.Tensor:
        """The dense ``[N, K]`` weight this layer multiplies by (tests, debugging)."""
        return torch.cat([dequantize_rows(blocks, qtype, layer.gguf_input_size)
                          for qtype, blocks in self._views(layer)]).to(dtype)


class GGUFEmbeddingMethod(EmbeddingMethod):
    """A token embedding / LM head table as uint8 ``weight [vocab_rows, bytes_per_row]`` of one
    GGUF type."""

    def __init__(self, config: GGUFConfig, qtype: str) -> None:
        self.config = config
        self.qtype = qtype

    def create_weights(self, layer: nn.Module, shape: LinearShape) -> None:
        hidden = shape.input_size
        layer.gguf_hidden_size = hidden
        layer.gguf_dtype = shape.params_dtype
        rows = torch.empty(shape.output_size, bytes_per_row(self.qtype, hidden),
                           dtype=torch.uint8)
        delattr(layer, "weight")
        param = add_param(layer, "weight", rows, ParamLayout(output_dim=None, input_dim=None))
        param.weight_loader = self._load  # type: ignore[attr-defined]

    def _load(self, param: nn.Parameter, loaded: Loaded, shard_name: str | None) -> None:
        from octavo.model_executor.loader.gguf_loader import GGUFBlocks

        if not isinstance(loaded, GGUFBlocks) or loaded.qtype != self.qtype:
            found = loaded.qtype if isinstance(loaded, GGUFBlocks) else "dense"
            raise ValueError(f"expected {self.qtype} blocks for the embedding, got a {found} "
                             "tensor")
        with torch.no_grad():
            copy_checked(param.data, loaded.blocks(), f"{self.qtype} embedding rows")

    def apply(self, layer: nn.Module, x: torch.Tensor,
              bias: torch.Tensor | None) -> torch.Tensor:
        out = gguf_linear(x, layer.weight, self.qtype, layer.gguf_hidden_size,
                          self.config.kernels)
        return out if bias is None else out + bias

    def embedding(self, layer: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
        rows = layer.weight.index_select(0, input_ids.reshape(-1))
        dequantize = getattr(self.config.kernels, "gguf_dequantize", None) or dequantize_rows
        table = dequantize(rows, self.qtype, layer.gguf_hidden_size)
        return table.to(layer.gguf_dtype).reshape(*input_ids.shape, layer.gguf_hidden_size)

    def dequantized_weight(self, layer: nn.Module, dtype: torch.dtype) -> torch.Tensor:
        """The dense ``[vocab_rows, hidden_size]`` table (tests, debugging)."""
        return dequantize_rows(layer.weight, self.qtype, layer.gguf_hidden_size).to(dtype)
