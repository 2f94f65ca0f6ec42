"""GPT-2 (``GPT2LMHeadModel``) for Octavo, attending through the backend's paged attention.

Pre-norm blocks: ``x + attn(ln_1(x))`` then ``x + mlp(ln_2(x))``, with learned absolute
position embeddings added to the token embeddings, a final ``ln_f`` and an LM head that is the
token embedding unless ``tie_word_embeddings`` is false. Module names follow the Hugging Face
checkpoint (``transformer.h.0.attn.c_attn``, ...), so loading is a rename-free copy, except that
GPT-2's ``Conv1D`` projections store ``[in_features, out_features]`` and are transposed into
``nn.Linear`` layout (``[out, in]``) on load.

Contract (the one ``octavo.model_executor.models.llama.LlamaForCausalLM`` defines): constructor
``(hf_config, attn_backend)``, ``forward(input_ids, positions, kv_caches, attn_metadata)`` ->
hidden states after the final norm, ``compute_logits``, ``load_weights``. Parameters are
allocated uninitialised; ``load_weights`` must fill all of them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from octavo.attention.base import AttentionBackend, AttentionMetadata
from octavo.model_executor.layers import Attention
from octavo.model_executor.models.llama import load_hf_weights, uninitialized
from torch import nn

# config.activation_function -> activation (the ones GPT-2-shaped checkpoints use).
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_fast": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
    "relu": F.relu,
    "silu": F.silu,
    "swish": F.silu,
}

# Checkpoint tensors stored by HF's Conv1D as [in_features, out_features].
CONV1D_SUFFIXES = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
# Causal-mask buffers that older GPT-2 checkpoints save next to the weights.
IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias")


def activation_of(config: Any) -> Callable[[torch.Tensor], torch.Tensor]:
    """The MLP activation named by ``config.activation_function``; ``ValueError`` if unknown."""
    name = getattr(config, "activation_function", "gelu_new")
    if name not in ACTIVATIONS:
        raise ValueError(
            f"GPT-2 activation_function {name!r} is not supported; use one of {sorted(ACTIVATIONS)}"
        )
    return ACTIVATIONS[name]


class GPT2Attention(nn.Module):
    """Multi-head self-attention (no grouped-query heads) over the paged KV cache."""

    def __init__(self, config: Any, layer_idx: int, attn_backend: AttentionBackend) -> None:
        super().__init__()
        hidden_size = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = hidden_size // self.num_heads
        if self.head_dim * self.num_heads != hidden_size:
            raise ValueError(
                f"GPT-2 n_embd ({hidden_size}) must be a multiple of n_head ({self.num_heads})"
            )
        scale = self.head_dim**-0.5 if getattr(config, "scale_attn_weights", True) else 1.0
        if getattr(config, "scale_attn_by_inverse_layer_idx", False):
            scale /= layer_idx + 1
        self.c_attn = uninitialized(nn.Linear, hidden_size, 3 * hidden_size)
        self.c_proj = uninitialized(nn.Linear, hidden_size, hidden_size)
        self.attn = Attention(self.num_heads, self.num_heads, self.head_dim, scale, attn_backend)

    def forward(
        self,
        hidden_states: torch.Tensor,  # [num_tokens, hidden_size]
        kv_cache: torch.Tensor,
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, hidden_size]
        num_tokens = hidden_states.shape[0]
        qkv = self.c_attn(hidden_states)  # [num_tokens, 3 * hidden_size]
        q, k, v = (
            t.view(num_tokens, self.num_heads, self.head_dim)  # [num_tokens, num_heads, head_dim]
            for t in qkv.chunk(3, dim=-1)
        )
        out = self.attn(q, k, v, kv_cache, attn_metadata)  # [num_tokens, hidden_size]
        return self.c_proj(out)


class GPT2MLP(nn.Module):
    """``c_proj(act(c_fc(x)))`` with the inner size ``n_inner`` (default ``4 * n_embd``)."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        inner = getattr(config, "n_inner", None) or 4 * config.hidden_size
        self.c_fc = uninitialized(nn.Linear, config.hidden_size, inner)
        self.c_proj = uninitialized(nn.Linear, inner, config.hidden_size)
        self.act = activation_of(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [num_tokens, hidden_size]
        return self.c_proj(self.act(self.c_fc(x)))  # [num_tokens, hidden_size]


class GPT2Block(nn.Module):
    """One pre-norm block: attention then MLP, each added to the residual stream."""

    def __init__(self, config: Any, layer_idx: int, attn_backend: AttentionBackend) -> None:
        super().__init__()
        eps = config.layer_norm_epsilon
        self.ln_1 = uninitialized(nn.LayerNorm, config.hidden_size, eps=eps)
        self.attn = GPT2Attention(config, layer_idx, attn_backend)
        self.ln_2 = uninitialized(nn.LayerNorm, config.hidden_size, eps=eps)
        self.mlp = GPT2MLP(config)

    def forward(
        self,
        hidden_states: torch.Tensor,  # [num_tokens, hidden_size]
        kv_cache: torch.Tensor,
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, hidden_size]
        hidden_states = hidden_states + self.attn(self.ln_1(hidden_states), kv_cache, attn_metadata)
        return hidden_states + self.mlp(self.ln_2(hidden_states))


class GPT2Model(nn.Module):
    """Token and position embeddings, the blocks and ``ln_f`` (the ``transformer.`` prefix)."""

    def __init__(self, config: Any, attn_backend: AttentionBackend) -> None:
        super().__init__()
        self.wte = uninitialized(nn.Embedding, config.vocab_size, config.hidden_size)
        self.wpe = uninitialized(nn.Embedding, config.max_position_embeddings, config.hidden_size)
        self.h = nn.ModuleList(
            GPT2Block(config, i, attn_backend) for i in range(config.num_hidden_layers)
        )
        self.ln_f = uninitialized(nn.LayerNorm, config.hidden_size, eps=config.layer_norm_epsilon)

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        kv_caches: list[torch.Tensor],
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, hidden_size]
        if len(kv_caches) != len(self.h):
            raise ValueError(f"got {len(kv_caches)} KV caches for {len(self.h)} layers")
        hidden_states = self.wte(input_ids) + self.wpe(positions)  # [num_tokens, hidden_size]
        for block, kv_cache in zip(self.h, kv_caches):
            hidden_states = block(hidden_states, kv_cache, attn_metadata)
        return self.ln_f(hidden_states)


class GPT2LMHeadModel(nn.Module):
    """GPT-2 decoder plus LM head; the interface the model runner calls."""

    def __init__(self, config: Any, attn_backend: AttentionBackend) -> None:
        super().__init__()
        if getattr(config, "add_cross_attention", False):
            raise ValueError("GPT-2 with cross-attention (add_cross_attention) is not supported")
        self.config = config
        self.transformer = GPT2Model(config, attn_backend)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", True))
        self.lm_head: nn.Linear | None = None
        if not self.tie_word_embeddings:
            self.lm_head = uninitialized(nn.Linear, config.hidden_size, config.vocab_size, bias=False)

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens] int64
        positions: torch.Tensor,  # [num_tokens] int64
        kv_caches: list[torch.Tensor],  # one per layer, the backend's layout
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, hidden_size], after ln_f
        return self.transformer(input_ids, positions, kv_caches, attn_metadata)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``[n, hidden_size]`` -> float32 ``[n, vocab_size]`` (matmul in the model dtype)."""
        weight = self.transformer.wte.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(hidden_states, weight).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy a Hugging Face GPT-2 checkpoint into the parameters.

        Raises ``ValueError`` (from ``load_hf_weights``) naming any missing, unknown or
        mis-shaped tensor.
        """
        load_hf_weights(self, hf_to_octavo(weights, tied=self.tie_word_embeddings))


def hf_to_octavo(
    weights: Iterable[tuple[str, torch.Tensor]], tied: bool
) -> Iterator[tuple[str, torch.Tensor]]:
    """Checkpoint ``(name, tensor)`` pairs as this module names and lays them out.

    Adds the ``transformer.`` prefix that ``GPT2Model`` checkpoints lack, drops causal-mask
    buffers and (when tied) ``lm_head.weight``, and transposes ``Conv1D`` weights to ``[out, in]``.
    """
    for name, tensor in weights:
        if not name.startswith(("transformer.", "lm_head.")):
            name = f"transformer.{name}"
        if name.endswith(IGNORED_SUFFIXES) or (tied and name == "lm_head.weight"):
            continue
        if name.endswith(CONV1D_SUFFIXES):
            tensor = tensor.t()  # [in_features, out_features] -> [out_features, in_features]
        yield name, tensor
