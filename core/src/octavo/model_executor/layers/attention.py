"""The attention layer models use: reshapes heads and calls the backend's ``AttentionImpl``."""

from __future__ import annotations

import torch
from torch import nn

from octavo.attention.base import (
    AttentionBackend,
    AttentionMetadata,
    Rotation,
    check_attention_options,
)


class Attention(nn.Module):
    """Paged causal attention for one decoder layer; owns no parameters.

    The kernel comes from ``attn_backend.make_impl`` at construction. ``forward`` writes the new
    tokens' K/V into ``kv_cache`` (the backend's layout) and attends over each sequence's cached
    context as described by ``attn_metadata``: its last ``sliding_window`` positions when set,
    with scores soft-capped at ``logits_soft_cap`` when set. A backend that does not implement
    an option the layer needs is refused here with a ``ValueError`` saying what to do.
    """

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        attn_backend: AttentionBackend,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.sliding_window = sliding_window
        self.logits_soft_cap = logits_soft_cap
        options = check_attention_options(attn_backend, sliding_window, logits_soft_cap)
        self.impl = attn_backend.make_impl(num_heads, num_kv_heads, head_dim, scale, **options)

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

    def forward_rotary(
        self,
        positions: torch.Tensor,  # [num_tokens]
        rotary: Rotation,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim], not rotated yet
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim], not rotated yet
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, num_heads * head_dim]
        """``forward`` of ``rotary``'s rotation of ``query`` and ``key``, which the backend may
        fuse with the cache write (``AttentionImpl.forward_rotary``)."""
        out = self.impl.forward_rotary(positions, rotary, query, key, value, kv_cache,
                                       attn_metadata)
        return out.reshape(out.shape[0], self.num_heads * self.head_dim)
