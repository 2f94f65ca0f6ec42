"""GGUF weights kept in their blocks, multiplied by a backend's kernels (#18; interim seam).

This module is the whole integration of quantized GGUF compute until the quantization-method
registry of #17 lands; rewiring it there means replacing ``register_gguf_kernels`` by that
registry and ``GGUFLinear``/``GGUFEmbedding`` by its layer methods. Without registered
kernels nothing here runs and GGUF files load as before (dequantized to the model dtype).

- A backend whose device can compute on GGUF blocks registers its :class:`GGUFKernels` for its
  device type (the CPU backend does when its C++ kernels load, ``octavo_cpu.worker``).
- ``model_loader.load_model`` then calls :func:`quantize_gguf_layers` on the freshly built
  model (parameters still unallocated in practice: ``torch.empty``): every linear layer
  (merged QKV, o_proj, merged gate/up, down_proj) and the token embedding / LM head whose GGUF
  tensors are in a qtype the kernels take is replaced by a module holding the raw blocks as a
  uint8 buffer ``[out_features, bytes_per_row]`` (the file's bytes; Llama's Q/K rows
  un-permuted like the float path). The names it consumed are left out of the float weight
  loading, which fills everything else (norms, biases of layers it skipped, ...).
- Only a model on one tensor-parallel rank is converted (the blocks of a rank's slice of the
  input features would need splitting inside blocks); split models keep the float path.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from octavo.model_executor.layers.linear import ColumnParallelLinear, RowParallelLinear
from octavo.model_executor.layers.vocab import VocabParallelEmbedding
from octavo.model_executor.loader.gguf_file import GGUFFile, GGUFTensorInfo, read_gguf
from octavo.model_executor.loader.gguf_loader import (
    dequantize,
    gguf_to_hf_name,
    permuted_heads,
    unpermute_qk,
)

logger = logging.getLogger(__name__)

# (x [tokens, in_features], blocks uint8 [out, bytes_per_row], qtype, in_features) -> y
GGUFMatmul = Callable[[torch.Tensor, torch.Tensor, str, int], torch.Tensor]
# (blocks uint8 [rows, bytes_per_row], qtype, in_features) -> float32 [rows, in_features]
GGUFDequantize = Callable[[torch.Tensor, str, int], torch.Tensor]


@dataclass(frozen=True, slots=True)
class GGUFKernels:
    """A device's kernels on GGUF blocks."""

    # y = x W^T with W in GGUF blocks; y in x's dtype.
    matmul: GGUFMatmul
    # The float32 rows of GGUF blocks (the embedding's lookups).
    dequantize: GGUFDequantize
    # GGUF type names the kernels take ("Q4_1", ...); tensors of other types stay float.
    qtypes: tuple[str, ...]
    # Activation dtypes the matmul takes; models of other dtypes stay float.
    dtypes: tuple[torch.dtype, ...]


_registry: dict[str, GGUFKernels] = {}


def register_gguf_kernels(device_type: str, kernels: GGUFKernels | None) -> None:
    """Make ``kernels`` the GGUF kernels of ``device_type`` in this process (None: forget)."""
    if kernels is None:
        _registry.pop(device_type, None)
    else:
        _registry[device_type] = kernels


def gguf_kernels_for(device_type: str) -> GGUFKernels | None:
    """The registered kernels of ``device_type``, or ``None``."""
    return _registry.get(device_type)


class GGUFLinear(nn.Module):
    """``y = x W^T + b`` with ``W`` in GGUF blocks: replaces a linear layer of one rank.

    ``W`` is one or more row ranges (merged projections whose GGUF tensors differ in type are
    several matmuls, concatenated).
    """

    def __init__(self, parts: list[tuple[str, torch.Tensor]], in_features: int,
                 bias: torch.Tensor | None, kernels: GGUFKernels) -> None:
        super().__init__()
        self.in_features = in_features
        self.qtypes = tuple(qtype for qtype, _ in parts)
        self.out_features = sum(blocks.shape[0] for _, blocks in parts)
        self.kernels = kernels
        for i, (_, blocks) in enumerate(parts):
            self.register_buffer(f"blocks_{i}", blocks)
        self.register_buffer("bias", bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        rows = x.reshape(-1, self.in_features)
        outs = [self.kernels.matmul(rows, getattr(self, f"blocks_{i}"), qtype, self.in_features)
                for i, qtype in enumerate(self.qtypes)]
        y = outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, qtypes={self.qtypes}"


class GGUFEmbedding(nn.Module):
    """The token embedding (and, tied or not, the LM head) with its table in GGUF blocks."""

    def __init__(self, qtype: str, blocks: torch.Tensor, hidden_size: int,
                 like: VocabParallelEmbedding, dtype: torch.dtype, kernels: GGUFKernels) -> None:
        super().__init__()
        self.qtype = qtype
        self.hidden_size = hidden_size
        self.vocab_size = like.vocab_size
        self.parallel = like.parallel  # one rank: compute_logits gathers nothing
        self.dtype = dtype
        self.kernels = kernels
        self.register_buffer("blocks", blocks)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # [n] -> [n, hidden_size]
        rows = self.blocks.index_select(0, input_ids.reshape(-1))
        table = self.kernels.dequantize(rows, self.qtype, self.hidden_size)
        return table.to(self.dtype).reshape(*input_ids.shape, self.hidden_size)

    def linear(self, hidden_states: torch.Tensor) -> torch.Tensor:  # [n, vocab_size]
        """The logits (what ``compute_logits`` calls on an LM head)."""
        return self.kernels.matmul(hidden_states, self.blocks, self.qtype, self.hidden_size)

    def extra_repr(self) -> str:
        return f"vocab={self.vocab_size}, hidden={self.hidden_size}, qtype={self.qtype}"


@dataclass(frozen=True, slots=True)
class _Tensor:
    """One GGUF tensor under its HF name."""

    info: GGUFTensorInfo
    # Heads whose rows llama.cpp permuted (Llama Q/K), else 0.
    permuted_heads: int


class _Converter:
    """Builds the replacement modules from one GGUF file."""

    def __init__(self, gguf_file: GGUFFile, kernels: GGUFKernels, dtype: torch.dtype) -> None:
        self.file = gguf_file
        self.kernels = kernels
        self.dtype = dtype
        heads = permuted_heads(gguf_file)
        self.tensors: dict[str, _Tensor] = {}
        for info in gguf_file.tensors:
            try:
                hf_name = gguf_to_hf_name(info.name)
            except ValueError:
                continue  # the float loader names it in its error
            num_heads = 0
            if ".attn_q." in info.name:
                num_heads = heads[0]
            elif ".attn_k." in info.name:
                num_heads = heads[1]
            self.tensors[hf_name] = _Tensor(info, num_heads)
        self.consumed: set[str] = set()

    def quantized(self, name: str) -> _Tensor | None:
        """The 2-D tensor ``name`` when it is in a qtype the kernels take."""
        tensor = self.tensors.get(name)
        if tensor is None or len(tensor.info.shape) != 2:
            return None
        return tensor if tensor.info.qtype.name in self.kernels.qtypes else None

    def blocks(self, tensor: _Tensor) -> torch.Tensor:
        """uint8 ``[out_features, bytes_per_row]``, rows un-permuted where llama.cpp permuted."""
        out_features = tensor.info.shape[1]
        data = self.file.tensor_data(tensor.info)  # read-only map of the file
        rows = torch.frombuffer(bytearray(data), dtype=torch.uint8).reshape(out_features, -1)
        if tensor.permuted_heads:
            rows = unpermute_qk(rows, tensor.permuted_heads)
        return rows

    def float_tensor(self, name: str) -> torch.Tensor | None:
        """A (small) float tensor such as a bias, un-permuted like the float loader does."""
        tensor = self.tensors.get(name)
        if tensor is None:
            return None
        values = dequantize(self.file.tensor_data(tensor.info), tensor.info.qtype)
        values = values.reshape(tuple(reversed(tensor.info.shape)))
        if tensor.permuted_heads:
            values = unpermute_qk(values, tensor.permuted_heads)
        return values.to(self.dtype)

    def linear(self, names: list[str], in_features: int, sizes: list[int],
               has_bias: bool) -> GGUFLinear | None:
        """The layer of the projections ``names`` (HF names without ``.weight``), or None when
        one of them is missing, of another shape (a split rank) or of a type not taken."""
        tensors = [self.quantized(f"{name}.weight") for name in names]
        if any(t is None or tuple(reversed(t.info.shape)) != (size, in_features)
               for t, size in zip(tensors, sizes)):
            return None
        biases = []
        if has_bias:
            biases = [self.float_tensor(f"{name}.bias") for name in names]
            if any(b is None for b in biases):
                return None
        parts: list[tuple[str, torch.Tensor]] = []
        for tensor in tensors:
            qtype, blocks = tensor.info.qtype.name, self.blocks(tensor)
            if parts and parts[-1][0] == qtype:  # one matmul for neighbours of the same type
                parts[-1] = (qtype, torch.cat([parts[-1][1], blocks]))
            else:
                parts.append((qtype, blocks))
        bias = torch.cat(biases) if biases else None
        self.consumed.update(f"{name}.weight" for name in names)
        self.consumed.update(f"{name}.bias" for name in names if has_bias)
        return GGUFLinear(parts, in_features, bias, self.kernels)

    def embedding(self, name: str, module: VocabParallelEmbedding) -> GGUFEmbedding | None:
        tensor = self.quantized(name)
        if tensor is None or module.parallel.tp_size != 1:
            return None
        vocab, hidden = tuple(reversed(tensor.info.shape))
        if (vocab, hidden) != tuple(module.weight.shape):
            return None
        self.consumed.add(name)
        return GGUFEmbedding(tensor.info.qtype.name, self.blocks(tensor), hidden, module,
                             self.dtype, self.kernels)


def quantize_gguf_layers(model: nn.Module, gguf_path, kernels: GGUFKernels,
                         dtype: torch.dtype) -> frozenset[str]:
    """Replace ``model``'s linear layers, embedding and LM head by GGUF-block modules where
    the file's tensors allow it; return the HF weight names they took (the float loading must
    skip them). A model the kernels cannot run (its dtype) is left alone (empty set)."""
    if dtype not in kernels.dtypes:
        logger.info("GGUF weights: dequantized (the kernels take %s, the model is %s)",
                    ", ".join(str(d).removeprefix("torch.") for d in kernels.dtypes),
                    str(dtype).removeprefix("torch."))
        return frozenset()
    converter = _Converter(read_gguf(gguf_path), kernels, dtype)
    replaced: dict[int, nn.Module] = {}
    for path, module in model.named_modules():
        new: nn.Module | None = None
        if isinstance(module, ColumnParallelLinear):
            parent = path.rpartition(".")[0]
            names = [f"{parent}.{s.name}" if parent else s.name for s in module.shards
                     if s.name is not None]
            if len(names) != len(module.shards):  # a single unnamed projection
                names = [path]
            if all(s.start == 0 for s in module.shards):
                new = converter.linear(names, module.input_size,
                                       [s.size for s in module.shards], module.bias is not None)
        elif isinstance(module, RowParallelLinear):
            if module.parallel.tp_size == 1:
                new = converter.linear([path], module.input_size, [module.output_size],
                                       module.bias is not None)
        elif isinstance(module, VocabParallelEmbedding):
            name = "lm_head.weight" if path == "lm_head" else f"{path}.weight"
            new = converter.embedding(name, module)
        if new is not None:
            replaced[id(module)] = new
    # Swap children everywhere they appear (a tied LM head is the embedding twice).
    for parent in model.modules():
        for child_name, child in list(parent.named_children()):
            if id(child) in replaced:
                setattr(parent, child_name, replaced[id(child)])
    if replaced:
        num_bytes = sum(b.numel() for m in replaced.values() for b in m.buffers())
        qtypes = sorted({q for m in replaced.values()
                         for q in getattr(m, "qtypes", (getattr(m, "qtype", None),))})
        logger.info("GGUF weights: %d layers kept in their blocks (%s, %.1f MiB); matmuls on "
                    "the backend's kernels", len(replaced), ", ".join(qtypes), num_bytes / 2**20)
    return frozenset(converter.consumed)
