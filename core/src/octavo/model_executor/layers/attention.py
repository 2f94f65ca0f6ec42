"""The attention layer models use: reshapes heads and calls the backend's ``AttentionImpl``."""

from __future__ import annotations

import torch
from torch import nn

from octavo.attention.base import AttentionBackend, AttentionMetadata


class Attention(nn.Module):
    """Paged causal attention for one decoder layer; owns no parameters.

    The kernel comes from ``attn_backend.make_impl`` at construction. ``forward`` writes the new
    tokens' K/V into ``kv_cache`` (the backend's layout) and attends over each sequence's cached
    context as described by ``attn_metadata``.
    """

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        attn_backend: AttentionBackend,
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.impl = attn_backend.make_impl(num_heads, num_kv_heads, head_dim, scale)

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, num_heads * head_dim]
        out = self.impl.forward(query, key, value, kv_cache, attn_metadata)
        return out.reshape(out.shape[0], self.num_heads * self.head_dim)
