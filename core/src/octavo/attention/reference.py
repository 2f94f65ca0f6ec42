"""Plain-torch paged attention: the reference every kernel is tested against.

Slow but obviously correct: one gather and one masked softmax per sequence. The CPU backend
uses it directly; Triton/C++ kernels are checked against it. An fp8 cache (``float8_e4m3fn``,
``octavo.attention.base``) is written through ``quantize_kv`` and read back times its scale.
"""

from __future__ import annotations

import torch

from octavo.attention.base import AttentionBackend, AttentionImpl, AttentionMetadata

#: Largest finite e4m3 value: fp8 K/V saturate there.
FP8_E4M3_MAX = float(torch.finfo(torch.float8_e4m3fn).max)


def is_fp8(kv_cache: torch.Tensor) -> bool:
    """Whether ``kv_cache`` holds scaled e4m3 values (``--kv-cache-dtype fp8``)."""
    return kv_cache.dtype == torch.float8_e4m3fn


def quantize_kv(x: torch.Tensor, scale: float) -> torch.Tensor:
    """``x / scale`` in e4m3, saturated to +-448 (what an fp8 cache stores)."""
    inverse = 1.0 / scale  # the kernels multiply by the inverse too
    return (x.to(torch.float32) * inverse).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(
        torch.float8_e4m3fn)


def write_kv_reference(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Scatter each token's K/V into its cache slot (slots < 0 are padding and skipped); an
    fp8 cache gets ``quantize_kv(key, k_scale)`` and ``quantize_kv(value, v_scale)``."""
    num_blocks, block_size = kv_cache.shape[1], kv_cache.shape[2]
    flat = kv_cache.view(2, num_blocks * block_size, *kv_cache.shape[3:])
    valid = slot_mapping >= 0
    if not bool(valid.all()):
        key, value, slot_mapping = key[valid], value[valid], slot_mapping[valid]
    if is_fp8(kv_cache):  # torch has no fp8 index_copy_: copy the bytes
        flat = flat.view(torch.uint8)
        key = quantize_kv(key, k_scale).view(torch.uint8)
        value = quantize_kv(value, v_scale).view(torch.uint8)
    flat[0].index_copy_(0, slot_mapping, key.to(flat.dtype))
    flat[1].index_copy_(0, slot_mapping, value.to(flat.dtype))


def gather_context(
    kv_cache: torch.Tensor, block_table: torch.Tensor, seq_len: int, start: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values ``[seq_len - start, num_kv_heads, head_dim]`` of positions
    ``start .. seq_len - 1`` of one sequence, in token order (blocks before ``start``'s are not
    read: under a sliding window they may belong to another request by now)."""
    block_size = kv_cache.shape[2]
    first_block = start // block_size
    num_blocks = (seq_len + block_size - 1) // block_size
    blocks = block_table[first_block:num_blocks].long()
    first, end = start - first_block * block_size, seq_len - first_block * block_size
    keys = kv_cache[0, blocks].reshape(-1, *kv_cache.shape[3:])[first:end]
    values = kv_cache[1, blocks].reshape(-1, *kv_cache.shape[3:])[first:end]
    return keys, values


def window_start(seq_len: int, query_len: int, sliding_window: int | None) -> int:
    """First cache position any of a sequence's new tokens sees (0 without a window)."""
    if sliding_window is None:
        return 0
    return max(0, seq_len - query_len - sliding_window + 1)


def soft_cap(scores: torch.Tensor, cap: float | None) -> torch.Tensor:
    """``cap * tanh(scores / cap)`` (the identity for ``cap=None``)."""
    return scores if cap is None else torch.tanh(scores / cap) * cap


def paged_attention_reference(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    kv_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    *,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Causal attention of every new token over its sequence's cached context (the last
    ``sliding_window`` positions of it when set; scores soft-capped by ``logits_soft_cap``; an
    fp8 cache's keys and values are read times ``k_scale`` and ``v_scale``)."""
    num_heads = query.shape[1]
    num_kv_heads = kv_cache.shape[3]
    group = num_heads // num_kv_heads
    out = torch.empty_like(query)
    starts = metadata.query_start_loc_cpu
    for i in range(metadata.num_seqs):
        q_start, q_end = starts[i], starts[i + 1]
        query_len = q_end - q_start
        if query_len == 0:
            continue
        seq_len = metadata.seq_lens_cpu[i]
        start = window_start(seq_len, query_len, sliding_window)
        keys, values = gather_context(kv_cache, metadata.block_tables[i], seq_len, start)
        # [num_heads, seq_len, head_dim] with K/V heads repeated for grouped-query attention
        keys, values = keys.to(torch.float32), values.to(torch.float32)
        if is_fp8(kv_cache):
            keys, values = keys * k_scale, values * v_scale
        keys = keys.repeat_interleave(group, dim=1).transpose(0, 1)
        values = values.repeat_interleave(group, dim=1).transpose(0, 1)
        q = query[q_start:q_end].to(torch.float32).transpose(0, 1)  # [heads, query_len, dim]
        # [heads, query_len, seq_len - start]
        scores = soft_cap(torch.matmul(q, keys.transpose(1, 2)) * scale, logits_soft_cap)
        context_len = seq_len - query_len
        q_pos = torch.arange(query_len, device=query.device).unsqueeze(1) + context_len
        k_pos = torch.arange(start, seq_len, device=query.device).unsqueeze(0)
        invisible = k_pos > q_pos
        if sliding_window is not None:
            invisible |= k_pos <= q_pos - sliding_window
        scores.masked_fill_(invisible, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[q_start:q_end] = torch.matmul(probs, values).transpose(0, 1).to(query.dtype)
    return out


class ReferenceAttentionImpl(AttentionImpl):
    """``AttentionImpl`` built from the reference functions above."""

    def forward(self, query, key, value, kv_cache, metadata):
        write_kv_reference(key, value, kv_cache, metadata.slot_mapping, self.k_scale,
                           self.v_scale)
        return paged_attention_reference(query, kv_cache, metadata, self.scale,
                                         self.sliding_window, self.logits_soft_cap,
                                         k_scale=self.k_scale, v_scale=self.v_scale)


class ReferenceAttentionBackend(AttentionBackend):
    """Backend whose every layer uses :class:`ReferenceAttentionImpl` (default KV layout)."""

    name = "torch-reference"
    supports_sliding_window = True
    supports_logits_soft_cap = True

    def make_impl(
        self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, *,
        sliding_window: int | None = None, logits_soft_cap: float | None = None,
    ) -> AttentionImpl:
        return ReferenceAttentionImpl(num_heads, num_kv_heads, head_dim, scale, sliding_window,
                                      logits_soft_cap)
