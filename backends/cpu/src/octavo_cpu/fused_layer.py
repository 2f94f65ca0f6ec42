"""Whole decoder layers as one C++ call on the CPU (``csrc/decoder_layer.cpp``).

At batch 1 a decode step of a small model spends more time in the Python between a layer's
ops (module calls, views, the GGUF wrappers) than in its small ops. After the model is loaded,
the CPU worker calls :func:`install_fused_decoder_layers`: every Llama-style decoder layer
whose parts the C++ op covers gets a ``fused_forward`` (``octavo.model_executor.models.llama.
LlamaDecoderLayer`` runs it instead of its own body); the others keep their Python forward.

The op calls the same C++ ops, in the same order, as the Python layer with the backend's
kernels, so the results are equal bit for bit (tests compare both). ``OCTAVO_CPU_FUSED_LAYERS=0``
turns it off.

Covered: ``LlamaDecoderLayer`` with ``LlamaAttention`` (no q/k norm, full rotary, no sliding
window or soft cap, the C++ paged attention), a ``LlamaMLP`` with SiLU-and-mul, ``RMSNorm``
norms, every linear layer in GGUF blocks of one type on the C++ kernels, no biases, no tensor
parallelism, and the backend's C++ layer ops registered. At each call the fused form declines
(returns ``None``: the Python body runs) when the step is not one it takes: a cache that is
not a 5-d tensor of the activations' dtype (the profile run's empty caches), or activations
of another dtype than the norms.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
from octavo import envs
from octavo.attention.base import AttentionMetadata
from octavo.kernels.host_layer_kernels import host_layer_kernels
from octavo.model_executor.layers.activation import SiluAndMul
from octavo.model_executor.layers.rmsnorm import RMSNorm
from octavo.model_executor.layers.rotary import RotaryEmbedding
from octavo.model_executor.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaMLP
from torch import nn

from octavo_cpu.attention import CPUAttentionImpl
from octavo_cpu.kernels import HEAD_DIM_MULTIPLE, load_kernels
from octavo_cpu.quant import _QTYPE_CODES

logger = logging.getLogger("octavo.cpu.fused_layer")  # under the octavo tree

# Activation dtypes the GGUF matmul op takes.
_DTYPES = (torch.float32, torch.bfloat16)


@dataclass(frozen=True, slots=True)
class _GGUFWeight:
    blocks: torch.Tensor  # uint8 [out_features, bytes_per_row]
    qtype: int  # csrc/quant_common.h's QType


def _gguf_weight(linear: nn.Module) -> _GGUFWeight | None:
    """The linear layer's weight as one run of GGUF blocks on the C++ kernels, else ``None``."""
    runs = getattr(linear, "gguf_runs", None)
    if (getattr(linear, "gguf_matmuls", None) is None or runs is None or len(runs) != 1
            or getattr(linear, "bias", None) is not None):
        return None
    qtype, blocks = runs[0]
    if qtype not in _QTYPE_CODES or blocks.device.type != "cpu":
        return None
    return _GGUFWeight(blocks, _QTYPE_CODES[qtype])


class FusedLlamaDecoderLayer:
    """``LlamaDecoderLayer.forward`` as one call of ``octavo_cpu::llama_decoder_layer``.

    Holds references to the layer's own tensors (no copies). Called with the layer's forward
    arguments; returns ``(block output, residual)``, or ``None`` for a step it does not take.
    """

    def __init__(self, op: Any, layer: LlamaDecoderLayer, weights: dict[str, _GGUFWeight]) -> None:
        attn: LlamaAttention = layer.self_attn
        self._op = op
        self._input_norm = layer.input_layernorm.weight
        self._post_norm = layer.post_attention_layernorm.weight
        self._eps = float(layer.input_layernorm.eps)
        self._weights = (weights["qkv"].blocks, weights["qkv"].qtype,
                         weights["o"].blocks, weights["o"].qtype,
                         weights["gate_up"].blocks, weights["gate_up"].qtype,
                         weights["down"].blocks, weights["down"].qtype)
        self._cos_sin = attn.rotary_emb.cos_sin_cache
        self._heads = (attn.num_heads, attn.num_kv_heads, attn.head_dim, float(attn.attn.scale))

    def __call__(self, positions: torch.Tensor, hidden_states: torch.Tensor,
                 residual: torch.Tensor | None, kv_cache: torch.Tensor,
                 attn_metadata: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor] | None:
        dtype = hidden_states.dtype
        if (kv_cache.dim() != 5 or kv_cache.dtype != dtype or dtype != self._input_norm.dtype
                or dtype not in _DTYPES or hidden_states.dim() != 2):
            return None
        md = attn_metadata
        out, residual = self._op(
            hidden_states, residual, positions, kv_cache, md.query_start_loc, md.seq_lens,
            md.block_tables, md.slot_mapping, self._input_norm, self._post_norm, self._eps,
            *self._weights, self._cos_sin, *self._heads)
        return out, residual


def _fused_for(op: Any, layer: nn.Module) -> FusedLlamaDecoderLayer | None:
    """The fused form of ``layer`` when the C++ op covers every part of it, else ``None``."""
    if type(layer) is not LlamaDecoderLayer:  # subclasses may change the body
        return None
    attn, mlp = layer.self_attn, layer.mlp
    if (type(attn) is not LlamaAttention or type(mlp) is not LlamaMLP
            or type(mlp.act) is not SiluAndMul):
        return None
    norms = (layer.input_layernorm, layer.post_attention_layernorm)
    if any(type(norm) is not RMSNorm for norm in norms) or norms[0].eps != norms[1].eps:
        return None
    if attn.q_norm is not None or attn.k_norm is not None:
        return None
    rotary = attn.rotary_emb
    if type(rotary) is not RotaryEmbedding or rotary.rotary_dim != rotary.head_dim:
        return None
    impl = attn.attn.impl
    if (not isinstance(impl, CPUAttentionImpl) or impl.kernels is None
            or attn.attn.sliding_window is not None or attn.attn.logits_soft_cap is not None
            or attn.head_dim % HEAD_DIM_MULTIPLE != 0):
        return None
    if attn.o_proj.parallel.tp_size != 1 or mlp.down_proj.parallel.tp_size != 1:
        return None
    weights = {"qkv": _gguf_weight(attn.qkv_proj), "o": _gguf_weight(attn.o_proj),
               "gate_up": _gguf_weight(mlp.gate_up_proj), "down": _gguf_weight(mlp.down_proj)}
    if any(weight is None for weight in weights.values()):
        return None
    return FusedLlamaDecoderLayer(op, layer, weights)  # type: ignore[arg-type]


def install_fused_decoder_layers(model: nn.Module) -> int:
    """Give every decoder layer of ``model`` that the C++ op covers its ``fused_forward``
    (and take it from the others); returns how many layers got one. Nothing is installed
    with ``OCTAVO_CPU_FUSED_LAYERS=0``, without the C++ kernels, or when the C++ layer ops
    are not registered (the fused form equals the Python path with them, not without)."""
    kernels = load_kernels()
    op = None if kernels is None else kernels.llama_decoder_layer_op
    enabled = envs.cpu_fused_layers() and op is not None
    host = host_layer_kernels("cpu")
    if host is None or host.fused_add_rms_norm is None or host.rotary_neox is None:
        enabled = False
    count = total = 0
    for module in model.modules():
        if not isinstance(module, LlamaDecoderLayer):
            continue
        total += 1
        fused = _fused_for(op, module) if enabled else None
        module.fused_forward = fused
        count += fused is not None
    if total:
        logger.debug("cpu backend: %d of %d decoder layers run as one C++ call", count, total)
    return count
