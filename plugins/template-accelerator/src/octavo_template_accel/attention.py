"""The template's paged attention, in plain torch over block tables.

VENDOR: this module is where your device kernels go. Keep the two entry points of
``TemplateAttentionImpl.forward`` (write the step's K/V into the cache, then attend) and
replace their bodies with calls into your library; the conformance suite
(``pytest --octavo-backend NAME --pyargs octavo.testing.conformance``) checks them against
the core's reference.

The contract (``octavo.attention.base``): one cache tensor per layer, by default
``[2, num_blocks, block_size, num_kv_heads, head_dim]`` (keys, then values). Token ``t`` of
sequence ``i`` lives in block ``block_tables[i, t // block_size]`` at offset
``t % block_size``. A step holds ``num_seqs`` sequences; sequence ``i`` adds the new tokens
``query_start_loc[i]:query_start_loc[i + 1]`` after ``seq_lens[i] - query_len`` cached ones.
Write every new K/V first (a sequence may read a prefix block another one fills in the same
step), then attend causally. The cache is allocated uninitialised: never let a slot at or past
``seq_lens[i]`` reach a result.
"""

from __future__ import annotations

import torch
from octavo.attention.base import AttentionBackend, AttentionImpl, AttentionMetadata
from octavo.config import CacheConfig, ModelConfig


def make_attention_backend(
    model_config: ModelConfig, cache_config: CacheConfig
) -> AttentionBackend:
    """The attention implementation for this model (VENDOR: pick kernels by model here)."""
    return TemplateAttentionBackend()


class TemplateAttentionBackend(AttentionBackend):
    """Makes one ``TemplateAttentionImpl`` per attention layer."""

    name = "template-torch"

    # VENDOR: return the head sizes your kernels handle (None: any), and declare the same in
    # BackendCapabilities. Override get_kv_cache_shape too if your kernels want another cache
    # layout: the core allocates that shape and only your kernels ever read it.
    def supported_head_dims(self) -> tuple[int, ...] | None:
        return None

    def make_impl(
        self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float
    ) -> AttentionImpl:
        return TemplateAttentionImpl(num_heads, num_kv_heads, head_dim, scale)


class TemplateAttentionImpl(AttentionImpl):
    """One layer: cache write by slot mapping, then causal attention per sequence."""

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        self._write_kv(key, value, kv_cache, metadata.slot_mapping)  # VENDOR: cache-write kernel
        return self._attend(query, kv_cache, metadata)  # VENDOR: paged-attention kernel

    def _write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,  # [num_tokens] int64
    ) -> None:
        # A slot is a row of the cache seen as [2, num_blocks * block_size, kv_heads, dim];
        # view (not reshape) so the writes land in the cache itself.
        slots = kv_cache.view(2, -1, self.num_kv_heads, self.head_dim)
        slots[0, slot_mapping] = key.to(kv_cache.dtype)
        slots[1, slot_mapping] = value.to(kv_cache.dtype)

    def _attend(
        self, query: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        block_size = kv_cache.shape[2]
        group = self.num_heads // self.num_kv_heads
        out = torch.empty_like(query)
        starts, seq_lens = metadata.query_start_loc_cpu, metadata.seq_lens_cpu
        for i in range(metadata.num_seqs):
            start, end, seq_len = starts[i], starts[i + 1], seq_lens[i]
            if end == start:
                continue
            blocks = metadata.block_tables[i, : -(-seq_len // block_size)].long()
            # Only the first seq_len slots are read: unwritten slots never enter the math.
            keys = kv_cache[0, blocks].flatten(0, 1)[:seq_len]  # [seq_len, kv_heads, dim]
            values = kv_cache[1, blocks].flatten(0, 1)[:seq_len]
            keys = keys.float().repeat_interleave(group, dim=1)  # [seq_len, heads, dim]
            values = values.float().repeat_interleave(group, dim=1)
            q = query[start:end].float()  # [query_len, heads, dim]
            scores = torch.einsum("qhd,khd->hqk", q, keys) * self.scale
            # New token j of this step sits at position context_len + j and sees keys <= it.
            context_len = seq_len - (end - start)
            q_pos = torch.arange(end - start, device=query.device) + context_len
            k_pos = torch.arange(seq_len, device=query.device)
            scores.masked_fill_(k_pos[None, None, :] > q_pos[None, :, None], float("-inf"))
            probs = torch.softmax(scores, dim=-1)  # [heads, query_len, seq_len]
            out[start:end] = torch.einsum("hqk,khd->qhd", probs, values).to(query.dtype)
        return out
