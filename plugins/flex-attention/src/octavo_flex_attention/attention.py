"""Paged attention for the cpu backend on torch's FlexAttention.

KV-cache layout: the core's default, ``[2, num_blocks, block_size, num_kv_heads, head_dim]``,
which is also the cpu backend's, so the cpu worker and its memory sizing work unchanged.

One step's sequences are attended in FlexAttention batches, one batch row per sequence:

* all decode rows (one new token each) in one call: ``q [batch, heads, 1, dim]``;
* each prefill row (a prompt, or a chunk after a cached prefix) in its own call:
  ``q [1, heads, query_len, dim]``, so the dense scores of the eager path stay
  ``query_len x seq_len`` per head instead of growing with the batch's longest prompt.

A row's keys/values are its pages gathered through the block table in token order
(``[batch, kv_heads, num_pages * block_size, dim]``); the causal-after-prefix rule and the
sequence end are the block mask of :mod:`octavo_flex_attention.block_mask`. Gathered slots at or
past ``seq_len`` are zeroed: the cache is allocated uninitialised, and a masked-out NaN value
would still poison ``probs @ values`` (0 * NaN is NaN).

An fp8 KV cache (``--kv-cache-dtype fp8``) is written as the reference writes it and each
row's gathered pages are read back times the layer's ``k_scale``/``v_scale``.

A sliding window is part of the block mask (tiles wholly before a row's window are skipped,
and gathered slots before it are zeroed like those past the end: under a window their blocks
may hold another request's KV by now); a logit soft cap is FlexAttention's ``score_mod``.

``compiled=False`` calls ``flex_attention`` eagerly: torch evaluates it with an unfused
implementation that materialises the scores (correct on any CPU, no compiler needed).
``compiled=True`` uses ``torch.compile(flex_attention, dynamic=True)``, inductor's fused C++
kernel, which skips fully masked tiles; it compiles on first use (seconds to tens of seconds,
per shape family and dtype, depending on inductor's on-disk cache).
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable

import torch
from octavo.attention.base import AttentionBackend, AttentionImpl, AttentionMetadata
from octavo.attention.reference import is_fp8, write_kv_reference
from torch.nn.attention.flex_attention import flex_attention

from octavo_flex_attention.block_mask import causal_prefix_block_mask

FlexFn = Callable[..., torch.Tensor]


@functools.cache
def compiled_flex_attention() -> FlexFn:
    """``flex_attention`` compiled once per process, with dynamic shapes (no recompile per length)."""
    return torch.compile(flex_attention, dynamic=True)


def soft_cap_score_mod(cap: float) -> Callable[..., torch.Tensor]:
    """FlexAttention ``score_mod`` of a logit soft cap: ``cap * tanh(score / cap)`` (the score
    already scaled, as ``flex_attention`` applies ``scale`` first)."""

    def score_mod(score, b, h, q_idx, kv_idx):
        return torch.tanh(score / cap) * cap

    return score_mod


class FlexAttentionBackend(AttentionBackend):
    """Makes :class:`FlexAttentionImpl` layers; keeps the default (cpu backend) KV layout."""

    supports_sliding_window = True
    supports_logits_soft_cap = True

    def __init__(self, compiled: bool = False) -> None:
        self.compiled = compiled
        self.name = "cpu-flex-compiled" if compiled else "cpu-flex"
        if not compiled:
            # torch warns that eager flex_attention is unfused; here eager is chosen on purpose
            # (and the plugin logs it), so that one warning is silenced.
            warnings.filterwarnings(
                "ignore", message=r"flex_attention called without torch\.compile",
                category=UserWarning,
            )

    def make_impl(
        self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, *,
        sliding_window: int | None = None, logits_soft_cap: float | None = None,
    ) -> AttentionImpl:
        flex_fn = compiled_flex_attention() if self.compiled else flex_attention
        return FlexAttentionImpl(num_heads, num_kv_heads, head_dim, scale, flex_fn,
                                 sliding_window, logits_soft_cap)


class FlexAttentionImpl(AttentionImpl):
    """One layer: writes the step's K/V into the paged cache, then attends with FlexAttention."""

    def __init__(
        self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, flex_fn: FlexFn,
        sliding_window: int | None = None, logits_soft_cap: float | None = None,
    ) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim, scale, sliding_window,
                         logits_soft_cap)
        self.flex_fn = flex_fn
        self.score_mod = None if logits_soft_cap is None else soft_cap_score_mod(logits_soft_cap)

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        # Every new token's K/V first: a prefill may read prefix blocks another row fills.
        write_kv_reference(key, value, kv_cache, metadata.slot_mapping, self.k_scale,
                           self.v_scale)
        out = torch.empty_like(query)
        starts = metadata.query_start_loc_cpu
        query_lens = [starts[i + 1] - starts[i] for i in range(metadata.num_seqs)]
        decode_rows = [i for i, n in enumerate(query_lens) if n == 1]
        if decode_rows:
            self._attend(query, kv_cache, metadata, decode_rows, out)
        for row, n in enumerate(query_lens):
            if n > 1:
                self._attend(query, kv_cache, metadata, [row], out)
        return out

    def _attend(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        metadata: AttentionMetadata,
        rows: list[int],
        out: torch.Tensor,  # [num_tokens, num_heads, head_dim], written at the rows' tokens
    ) -> None:
        """Attend the new tokens of sequences ``rows`` as one FlexAttention batch."""
        device = query.device
        block_size = kv_cache.shape[2]
        starts = metadata.query_start_loc_cpu
        seq_lens_list = [metadata.seq_lens_cpu[i] for i in rows]
        query_lens_list = [starts[i + 1] - starts[i] for i in rows]
        batch, max_query_len = len(rows), max(query_lens_list)
        num_pages = -(-max(seq_lens_list) // block_size)
        kv_len = num_pages * block_size

        seq_lens = torch.tensor(seq_lens_list, device=device)  # [batch]
        query_lens = torch.tensor(query_lens_list, device=device)  # [batch]
        first_token = torch.tensor([starts[i] for i in rows], device=device)  # [batch]

        # Pages of each row in token order.  [batch, num_pages]
        pages = metadata.block_tables[rows, :num_pages].to(device=device, dtype=torch.long)
        shape = (batch, kv_len, self.num_kv_heads, self.head_dim)
        keys = kv_cache[0][pages].reshape(shape)  # [batch, kv_len, kv_heads, head_dim]
        values = kv_cache[1][pages].reshape(shape)
        if is_fp8(kv_cache):  # scaled e4m3: read back times the layer's scales
            keys = (keys.to(torch.float32) * self.k_scale).to(query.dtype)
            values = (values.to(torch.float32) * self.v_scale).to(query.dtype)
        kv_positions = torch.arange(kv_len, device=device)[None]  # [1, kv_len]
        past_end = kv_positions >= seq_lens[:, None]  # [batch, kv_len]
        if self.sliding_window is not None:  # before the first new token's window
            past_end |= kv_positions <= (seq_lens - query_lens - self.sliding_window)[:, None]
        keys.masked_fill_(past_end[:, :, None, None], 0.0)
        values.masked_fill_(past_end[:, :, None, None], 0.0)

        # Flat index of each row's new tokens; padded query slots repeat the row's first token.
        offsets = torch.arange(max_query_len, device=device)[None]  # [1, max_query_len]
        valid = offsets < query_lens[:, None]  # [batch, max_query_len]
        token_index = first_token[:, None] + offsets * valid  # [batch, max_query_len]
        q = query[token_index].transpose(1, 2)  # [batch, heads, max_query_len, head_dim]

        block_mask = causal_prefix_block_mask(
            seq_lens - query_lens, seq_lens, max_query_len, kv_len,
            sliding_window=self.sliding_window,
        )
        result = self.flex_fn(
            q,
            keys.transpose(1, 2),  # [batch, kv_heads, kv_len, head_dim]
            values.transpose(1, 2),
            score_mod=self.score_mod,
            block_mask=block_mask,
            scale=self.scale,
            enable_gqa=self.num_heads != self.num_kv_heads,
        )  # [batch, heads, max_query_len, head_dim]
        result = result.transpose(1, 2)  # [batch, max_query_len, heads, head_dim]
        out[token_index[valid]] = result[valid].to(out.dtype)
