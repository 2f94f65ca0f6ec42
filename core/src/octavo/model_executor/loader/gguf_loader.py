"""Read a llama.cpp GGUF file as a Hugging Face checkpoint: HF config, HF names, float32 weights.

The file is parsed once per process (``octavo.model_executor.loader.gguf_file.read_gguf``);
the config, the tokenizer (``octavo.engine.tokenizer``) and the weights share that parse.

Every tensor is dequantized to float32 on load (no quantized compute yet). Q4_0, Q4_1 and Q8_0,
the common types of small GGUFs, are dequantized here in vectorized torch; every other type goes
through the reference ``gguf.quants.dequantize`` (numpy), which the torch versions match exactly.

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


def iterate_gguf_weights(
    path: str | Path, exclude: frozenset[str] = frozenset()
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, float32 tensor)`` for every tensor of the GGUF file at ``path``.

    Names are HF's (``model.embed_tokens.weight``, ``model.layers.N.self_attn.q_proj.weight``,
    ..., ``model.norm.weight``, and ``lm_head.weight`` only when the file has ``output.weight``;
    tied models do not). Shapes are HF's (``[out_features, in_features]``). Llama's Q/K rows are
    un-permuted (see the module docstring). Tensors whose HF name is in ``exclude`` are skipped
    without being read (the layers ``octavo.model_executor.gguf_quantized`` keeps quantized).

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
    num_heads, num_kv_heads = permuted_heads(gguf_file)
    return _iterate(gguf_file, num_heads, num_kv_heads, exclude)


def permuted_heads(gguf_file: GGUFFile) -> tuple[int, int]:
    """``(num_heads, num_kv_heads)`` whose Q/K rows llama.cpp permuted; ``(0, 0)`` when the
    architecture is not permuted."""
    arch = gguf_file.architecture
    if arch not in _PERMUTED_ARCHITECTURES:
        return 0, 0
    num_heads = int(_read_field(gguf_file, f"{arch}.attention.head_count"))
    return num_heads, int(_read_field(gguf_file, f"{arch}.attention.head_count_kv", num_heads))


def _iterate(
    gguf_file: GGUFFile, num_heads: int, num_kv_heads: int, exclude: frozenset[str]
) -> Iterator[tuple[str, torch.Tensor]]:
    for tensor in gguf_file.tensors:
        if tensor.name in _SKIPPED_TENSORS:
            continue
        hf_name = gguf_to_hf_name(tensor.name)
        if hf_name in exclude:
            continue
        # GGUF lists dims innermost first; HF (and numpy) outermost first.
        shape = tuple(reversed(tensor.shape))
        weight = dequantize(gguf_file.tensor_data(tensor), tensor.qtype).reshape(shape)
        if num_heads and ".attn_q." in tensor.name:
            weight = unpermute_qk(weight, num_heads)
        elif num_heads and ".attn_k." in tensor.name:
            weight = unpermute_qk(weight, num_kv_heads)
        yield hf_name, weight


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

    Q4_0 / Q4_1 / Q8_0 use the torch kernels below; other types use ``gguf.quants.dequantize``.
    ``NotImplementedError`` (from gguf) for types that gguf cannot dequantize either.
    """
    kernel = _TORCH_KERNELS.get(qtype)
    if kernel is None:
        array = gguf.quants.dequantize(data, qtype)
        return torch.from_numpy(np.ascontiguousarray(array, dtype=np.float32).reshape(-1).copy())
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    # The reader's arrays are read-only memory maps; torch wants a writable buffer.
    blocks = torch.from_numpy(np.array(data, dtype=np.uint8).reshape(-1, type_size))
    return kernel(blocks).reshape(-1)  # [num_blocks * block_size]


def _fp16_column(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """Read the float16 stored at bytes ``start:start+2`` of each block, as float32 [n, 1]."""
    return blocks[:, start:start + 2].contiguous().view(torch.float16).float()


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """Unpack ``[n, 16]`` bytes to ``[n, 32]`` values: low nibbles first, then high nibbles."""
    return torch.cat([packed & 0x0F, packed >> 4], dim=1)


def _dequantize_q8_0(blocks: torch.Tensor) -> torch.Tensor:
    # block: fp16 scale d, 32 x int8 q; x = q * d
    scale = _fp16_column(blocks, 0)  # [n, 1]
    values = blocks[:, 2:].contiguous().view(torch.int8).float()  # [n, 32]
    return values * scale


def _dequantize_q4_0(blocks: torch.Tensor) -> torch.Tensor:
    # block: fp16 scale d, 16 bytes of 4-bit q; x = d * (q - 8)
    scale = _fp16_column(blocks, 0)  # [n, 1]
    values = _nibbles(blocks[:, 2:]).to(torch.int8) - 8  # [n, 32]
    return scale * values.float()


def _dequantize_q4_1(blocks: torch.Tensor) -> torch.Tensor:
    # block: fp16 scale d, fp16 min m, 16 bytes of 4-bit q; x = d * q + m
    scale = _fp16_column(blocks, 0)  # [n, 1]
    minimum = _fp16_column(blocks, 2)  # [n, 1]
    values = _nibbles(blocks[:, 4:]).float()  # [n, 32]
    return scale * values + minimum


_TORCH_KERNELS = {
    gguf.GGMLQuantizationType.Q8_0: _dequantize_q8_0,
    gguf.GGMLQuantizationType.Q4_0: _dequantize_q4_0,
    gguf.GGMLQuantizationType.Q4_1: _dequantize_q4_1,
}


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
