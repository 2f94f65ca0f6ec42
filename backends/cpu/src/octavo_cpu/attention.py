"""Paged attention for the CPU: C++ kernels, with plain torch as the fallback.

The C++ kernels (``octavo_cpu.kernels``, sources in ``octavo_cpu/csrc``) write the cache and
attend decode and prefill rows of a step in one call, vectorised for AVX2 or AVX-512 and run on
torch's threads. They take float32, bfloat16 and float16 with head dims that are multiples of
16; anything else, and every machine where they cannot be built, uses the torch code below.

Torch path: decode rows (one new token) of a step are batched: their context blocks are
gathered with the block table into one padded tensor and attended in a single masked matmul.
Prefill rows (prompts, chunks after a cached prefix) use ``scaled_dot_product_attention`` one
sequence at a time with a causal mask shifted by the cached context, or, with a logit soft
cap, the reference's masked softmax (SDPA has no soft cap). Both paths read only each
sequence's window under a sliding window, and are checked against ``octavo.attention.reference``.
An fp8 KV cache (``--kv-cache-dtype fp8``) always takes the torch path: K/V are quantized as the
reference does and read back times their scales.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from octavo.attention.base import AttentionBackend, AttentionImpl, AttentionMetadata
from octavo.attention.reference import (
    gather_context,
    is_fp8,
    soft_cap,
    window_start,
    write_kv_reference,
)
from octavo.config import CacheConfig, ModelConfig

from octavo_cpu.kernels import CPUKernels, load_kernels

logger = logging.getLogger("octavo.cpu.attention")  # under the octavo tree


def make_attention_backend(
    model_config: ModelConfig, cache_config: CacheConfig
) -> AttentionBackend:
    """The CPU kernels; one implementation serves every model and block size."""
    backend = CPUAttentionBackend()
    if backend.kernels is not None:
        dtype = getattr(model_config, "dtype", torch.float32)
        logger.info("cpu attention: C++ kernels (%s), %d threads",
                    backend.kernels.isa_for(dtype), torch.get_num_threads())
    return backend


class CPUAttentionBackend(AttentionBackend):
    name = "cpu-torch"
    supports_sliding_window = True
    supports_logits_soft_cap = True

    def __init__(self, use_kernels: bool = True) -> None:
        # Built (first use) or loaded here, when the backend is chosen; None = torch only.
        self.kernels: CPUKernels | None = load_kernels() if use_kernels else None

    def make_impl(self, num_heads, num_kv_heads, head_dim, scale, *, sliding_window=None,
                  logits_soft_cap=None):
        return CPUAttentionImpl(num_heads, num_kv_heads, head_dim, scale, kernels=self.kernels,
                                sliding_window=sliding_window, logits_soft_cap=logits_soft_cap)


class CPUAttentionImpl(AttentionImpl):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 kernels: CPUKernels | None = None, sliding_window: int | None = None,
                 logits_soft_cap: float | None = None) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim, scale, sliding_window,
                         logits_soft_cap)
        self.kernels = kernels

    def forward(self, query, key, value, kv_cache, metadata):
        if self.kernels is not None and self.kernels.covers(query, kv_cache):
            self.kernels.write_kv_cache(key, value, kv_cache, metadata.slot_mapping)
            return self.kernels.paged_attention(
                query, kv_cache, metadata, self.scale, sliding_window=self.sliding_window,
                logits_soft_cap=self.logits_soft_cap)
        write_kv_reference(key, value, kv_cache, metadata.slot_mapping, self.k_scale,
                           self.v_scale)
        out = torch.empty_like(query)
        starts = metadata.query_start_loc_cpu
        decode_rows = [i for i in range(metadata.num_seqs) if starts[i + 1] - starts[i] == 1]
        if decode_rows:
            self._decode(query, kv_cache, metadata, decode_rows, out)
        if len(decode_rows) < metadata.num_seqs:
            decode_set = set(decode_rows)
            for i in range(metadata.num_seqs):
                if i not in decode_set and starts[i + 1] > starts[i]:
                    self._prefill(query, kv_cache, metadata, i, out)
        return out

    def _cache_scales(self, kv_cache: torch.Tensor) -> tuple[float, float]:
        """(k_scale, v_scale) to read ``kv_cache`` with: an fp8 cache's, else (1, 1)."""
        return (self.k_scale, self.v_scale) if is_fp8(kv_cache) else (1.0, 1.0)

    def _decode(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, kv_heads, head_dim]
        metadata: AttentionMetadata,
        rows: list[int],
        out: torch.Tensor,
    ) -> None:
        block_size = kv_cache.shape[2]
        token_index = metadata.query_start_loc[rows].long()  # [batch]
        seq_lens = metadata.seq_lens[rows].long()  # [batch]
        max_blocks = -(-int(seq_lens.max()) // block_size)
        tables = metadata.block_tables[rows, :max_blocks].long()  # [batch, max_blocks]
        batch = len(rows)
        ctx = max_blocks * block_size
        # [batch, ctx, kv_heads, head_dim]
        keys = kv_cache[0][tables].reshape(batch, ctx, self.num_kv_heads, self.head_dim)
        values = kv_cache[1][tables].reshape(batch, ctx, self.num_kv_heads, self.head_dim)
        group = self.num_heads // self.num_kv_heads
        q = query[token_index].view(batch, self.num_kv_heads, group, self.head_dim)
        # [batch, kv_heads, group, ctx]
        k_scale, v_scale = self._cache_scales(kv_cache)
        scores = torch.einsum("bhgd,bchd->bhgc", q.float(), keys.float()) * (self.scale * k_scale)
        scores = soft_cap(scores, self.logits_soft_cap)
        positions = torch.arange(ctx)
        pad = positions >= seq_lens.unsqueeze(1)  # [batch, ctx]
        if self.sliding_window is not None:  # before the window: maybe another request's KV
            pad |= positions <= (seq_lens - 1 - self.sliding_window).unsqueeze(1)
        scores.masked_fill_(pad[:, None, None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        # Padded slots were never written and may hold NaN; 0 * NaN would poison the sum.
        values = values.float().masked_fill(pad[:, :, None, None], 0.0)
        result = torch.einsum("bhgc,bchd->bhgd", probs, values) * v_scale
        out[token_index] = result.reshape(batch, self.num_heads, self.head_dim).to(out.dtype)

    def _prefill(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        row: int,
        out: torch.Tensor,
    ) -> None:
        start, end = metadata.query_start_loc_cpu[row], metadata.query_start_loc_cpu[row + 1]
        query_len = end - start
        seq_len = metadata.seq_lens_cpu[row]
        first = window_start(seq_len, query_len, self.sliding_window)
        keys, values = gather_context(kv_cache, metadata.block_tables[row], seq_len, first)
        if is_fp8(kv_cache):
            keys = keys.to(torch.float32) * self.k_scale
            values = values.to(torch.float32) * self.v_scale
        q = query[start:end].transpose(0, 1).unsqueeze(0)  # [1, heads, query_len, dim]
        k = keys.transpose(0, 1).unsqueeze(0)  # [1, kv_heads, seq_len - first, dim]
        v = values.transpose(0, 1).unsqueeze(0)
        context_len = seq_len - query_len
        if context_len == 0 and self.sliding_window is None and self.logits_soft_cap is None:
            mask, causal = None, True
        else:
            q_pos = torch.arange(query_len).unsqueeze(1) + context_len
            k_pos = torch.arange(first, seq_len).unsqueeze(0)
            mask, causal = k_pos <= q_pos, False
            if self.sliding_window is not None:
                mask &= k_pos > q_pos - self.sliding_window
        if self.logits_soft_cap is not None:  # SDPA has no soft cap: the masked softmax
            group = self.num_heads // self.num_kv_heads
            k = k.float().repeat_interleave(group, dim=1)
            v = v.float().repeat_interleave(group, dim=1)
            scores = soft_cap(q.float() @ k.transpose(-1, -2) * self.scale, self.logits_soft_cap)
            probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
            result = (probs @ v).to(out.dtype)
        else:
            result = F.scaled_dot_product_attention(
                q, k.to(q.dtype), v.to(q.dtype), attn_mask=mask, is_causal=causal,
                scale=self.scale, enable_gqa=self.num_heads != self.num_kv_heads,
            )
        out[start:end] = result.squeeze(0).transpose(0, 1)
