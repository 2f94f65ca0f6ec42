"""Read a llama.cpp GGUF file as a Hugging Face checkpoint: HF config, HF names, float32 weights.

The file is parsed once per process (``octavo.model_executor.loader.gguf_file.read_gguf``);
the config, the tokenizer (``octavo.engine.tokenizer``) and the weights share that parse.

Tensors are dequantized to float32 on load, or, for a model run with the ``gguf`` quantization
method (``keep_quantized``), quantized 2-D weights of the types it keeps (Q4_0, Q4_1, Q8_0,
Q4_K, Q6_K) come as ``GGUFBlocks``: their raw blocks for the method's layers, dequantized only
by a dense parameter's loader (an embedding the method does not keep). Those five types are dequantized in vectorized
torch (``octavo.kernels.gguf``); every other type goes through the reference
``gguf.quants.dequantize`` (numpy), which the torch versions match exactly.

llama.cpp's converter permutes the rows of Llama's ``attn_q``/``attn_k`` (weights and biases) so
each head's rotary pairs are interleaved (GPT-J style) rather than split in halves (GPT-NeoX
style, what HF uses). The permutation is undone here so the tensors equal the original HF
checkpoint. Qwen2/Qwen3 keep HF's layout and are not permuted.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import gguf
import numpy as np
import torch

from octavo.kernels.gguf import GGUF_BLOCKS, dequantize_blocks, dequantize_rows
from octavo.model_executor.loader.gguf_file import GGUFFile, read_gguf
from octavo.model_executor.loader.gguf_hf import gguf_hf_config

if TYPE_CHECKING:
    from transformers import PretrainedConfig

logger = logging.getLogger(__name__)

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3")
# Architectures whose attn_q / attn_k rows llama.cpp permutes (Mistral GGUFs say "llama").
_PERMUTED_ARCHITECTURES = ("llama",)
# GGUF tensors that are not HF parameters (llama3 rope factors live in the HF config instead).
_SKIPPED_TENSORS = frozenset({"rope_freqs.weight"})

_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCK_PATTERN = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_GLOBAL_PATTERN = re.compile(r"(\w+)\.(weight|bias)")


def load_gguf_config(path: str | Path) -> PretrainedConfig:
    """Return the HF config that transformers derives from the GGUF metadata at ``path``
    (built from this process's one parse of the file, :func:`read_gguf`)."""
    return gguf_hf_config(read_gguf(path))


def iterate_gguf_weights(path: str | Path, keep_quantized: bool = False
                         ) -> Iterator[tuple[str, torch.Tensor | GGUFBlocks]]:
    """Yield ``(hf_name, float32 tensor)`` for every tensor of the GGUF file at ``path``
    (with ``keep_quantized``, a ``GGUFBlocks`` for each quantized 2-D weight it can keep).

    Names are HF's (``model.embed_tokens.weight``, ``model.layers.N.self_attn.q_proj.weight``,
    ..., ``model.norm.weight``, and ``lm_head.weight`` only when the file has ``output.weight``;
    tied models do not). Shapes are HF's (``[out_features, in_features]``). Llama's Q/K rows are
    un-permuted (see the module docstring).

    The file and its architecture are checked when this function is called:
    ``FileNotFoundError`` for a missing file, ``ValueError`` for an architecture outside
    :data:`SUPPORTED_ARCHITECTURES`. A tensor name with no HF equivalent raises ``ValueError``
    when reached.
    """
    gguf_file = read_gguf(path)
    arch = _read_field(gguf_file, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"GGUF architecture {arch!r} of {str(path)!r} is not supported; supported "
            f"architectures: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    num_heads = num_kv_heads = 0
    if arch in _PERMUTED_ARCHITECTURES:
        num_heads = int(_read_field(gguf_file, f"{arch}.attention.head_count"))
        num_kv_heads = int(_read_field(gguf_file, f"{arch}.attention.head_count_kv", num_heads))
    return _iterate(gguf_file, num_heads, num_kv_heads, keep_quantized)


def _iterate(
    gguf_file: GGUFFile, num_heads: int, num_kv_heads: int, keep_quantized: bool
) -> Iterator[tuple[str, torch.Tensor | GGUFBlocks]]:
    for tensor in gguf_file.tensors:
        if tensor.name in _SKIPPED_TENSORS:
            continue
        hf_name = gguf_to_hf_name(tensor.name)
        # GGUF lists dims innermost first; HF (and numpy) outermost first.
        shape = tuple(reversed(tensor.shape))
        heads = 0
        if num_heads and ".attn_q." in tensor.name:
            heads = num_heads
        elif num_heads and ".attn_k." in tensor.name:
            heads = num_kv_heads
        if keep_quantized and len(shape) == 2 and tensor.qtype.name in GGUF_BLOCKS:
            yield hf_name, GGUFBlocks(gguf_file.tensor_data(tensor), tensor.qtype.name,
                                      (shape[0], shape[1]), heads)
            continue
        weight = dequantize(gguf_file.tensor_data(tensor), tensor.qtype).reshape(shape)
        yield hf_name, unpermute_qk(weight, heads) if heads else weight


def gguf_weight_types(path: str | Path) -> dict[str, str]:
    """HF weight name -> GGUF storage type name (``"Q4_1"``, ``"F32"``, ...) of every tensor."""
    gguf_file = read_gguf(path)
    return {gguf_to_hf_name(t.name): t.qtype.name for t in gguf_file.tensors
            if t.name not in _SKIPPED_TENSORS}


def gguf_to_hf_name(name: str) -> str:
    """Map a llama.cpp tensor name (``blk.3.attn_q.weight``) to HF's (``model.layers.3....``)."""
    if match := _BLOCK_PATTERN.fullmatch(name):
        layer, part, kind = match.groups()
        if part in _BLOCK_NAMES:
            return f"model.layers.{layer}.{_BLOCK_NAMES[part]}.{kind}"
    elif (match := _GLOBAL_PATTERN.fullmatch(name)) and match.group(1) in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[match.group(1)]}.{match.group(2)}"
    raise ValueError(
        f"GGUF tensor {name!r} has no Hugging Face equivalent for the supported architectures "
        f"({', '.join(SUPPORTED_ARCHITECTURES)}); the file may be of another model family"
    )


def unpermute_qk(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's rotary permutation of a Q or K weight/bias (rows = heads * head_dim).

    llama.cpp viewed each head's rows as ``[2, head_dim / 2]`` (HF's two rotary halves) and
    transposed to ``[head_dim / 2, 2]`` (interleaved pairs); this transposes back.
    """
    rows = weight.shape[0]
    assert rows % (2 * num_heads) == 0, f"{rows} rows do not split into {num_heads} heads"
    # [num_heads, head_dim / 2, 2, *rest] -> [num_heads, 2, head_dim / 2, *rest]
    split = weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:])
    return split.transpose(1, 2).reshape(weight.shape).contiguous()


def dequantize(data: np.ndarray, qtype: gguf.GGMLQuantizationType) -> torch.Tensor:
    """Dequantize a GGUF tensor's stored data (``GGUFFile.tensor_data``, or ``GGUFReader``'s
    ``tensor.data``) to float32, flat.

    The types Octavo keeps quantized (``octavo.kernels.gguf.GGUF_BLOCKS``) use its torch
    kernels; other types use ``gguf.quants.dequantize``. ``NotImplementedError`` (from gguf)
    for types that gguf cannot dequantize either.
    """
    if qtype.name not in GGUF_BLOCKS:
        array = gguf.quants.dequantize(data, qtype)
        return torch.from_numpy(np.ascontiguousarray(array, dtype=np.float32).reshape(-1).copy())
    _, type_size = GGUF_BLOCKS[qtype.name]
    return dequantize_blocks(_block_bytes(data, type_size), qtype.name).reshape(-1)


def _block_bytes(data: np.ndarray, type_size: int) -> torch.Tensor:
    """uint8 ``[num_blocks, type_size]``, copied: the reader's arrays are read-only maps."""
    return torch.from_numpy(np.array(data, dtype=np.uint8).reshape(-1, type_size))


class GGUFBlocks:
    """A quantized GGUF weight kept in its blocks: a ``CheckpointTensor``
    (``octavo.model_executor.layers.weights``) whose ``load``/``narrow`` dequantize to float32
    (what a dense parameter's loader gets), and whose ``blocks()`` are the raw rows the
    ``gguf`` quantization method keeps."""

    __slots__ = ("_data", "qtype", "shape", "_num_heads")

    def __init__(self, data: np.ndarray, qtype: str, shape: tuple[int, int],
                 num_heads: int = 0) -> None:
        self._data = data
        # Block type name ("Q4_1", ...).
        self.qtype = qtype
        # HF shape: [out_features, in_features].
        self.shape = shape
        # Llama q/k rows to un-permute (heads), 0 for none.
        self._num_heads = num_heads

    def blocks(self) -> torch.Tensor:
        """uint8 ``[out_features, bytes_per_row]``, rows in HF order."""
        rows = _block_bytes(self._data, GGUF_BLOCKS[self.qtype][1]).reshape(self.shape[0], -1)
        return unpermute_qk(rows, self._num_heads) if self._num_heads else rows

    def load(self) -> torch.Tensor:
        return dequantize_rows(self.blocks(), self.qtype, self.shape[1])

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        return self.load().narrow(dim, start, length)


def _read_field(gguf_file: GGUFFile, key: str, default: Any = None) -> Any:
    """Return metadata ``key``; ``default`` when absent, or ``ValueError`` if that is ``None``."""
    value = gguf_file.metadata.get(key)
    if value is None:
        if default is None:
            raise ValueError(
                f"GGUF metadata key {key!r} is missing; the file is incomplete or was not made "
                "by llama.cpp's converter"
            )
        return default
    return value
