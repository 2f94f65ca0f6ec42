"""FlexAttention masks for causal attention after a cached prefix, one batch row per sequence.

A batch row ``b`` holds one sequence's new queries (``q_idx`` 0.. its query length) and its
whole context gathered in token order (``kv_idx`` 0.. ``seq_len - 1``, padded to the batch's
longest). Query ``q_idx`` is the token at position ``context_len[b] + q_idx``, where
``context_len = seq_len - query_len`` tokens were already cached (a prefix-cache hit or earlier
prefill chunks), so it may see::

    kv_idx <= context_len[b] + q_idx   and   kv_idx < seq_len[b]

The second bound keeps padding (slots of the batch past this sequence's end) out, and it means
a padded query row (``q_idx`` past the row's query length) still sees the whole context: no row
is ever fully masked. Its output is discarded by the caller.

With a sliding window ``W`` a query also sees only ``kv_idx > context_len[b] + q' - W``, where
``q' = min(q_idx, query_len[b] - 1)``: a padded row gets the last real row's window, so it is
never fully masked either.

:func:`causal_prefix_block_mask` builds the ``BlockMask`` directly from these bounds (a few
small tensor ops) instead of evaluating the mask function on every (q, kv) pair the way
``create_block_mask`` does; ``tests/plugins/test_flex_attention.py`` checks the two agree.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.nn.attention.flex_attention import BlockMask

# Tile size of the block mask along queries and keys (FlexAttention's default).
FLEX_BLOCK_SIZE = 128

MaskMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def causal_prefix_mask_mod(context_lens: torch.Tensor, seq_lens: torch.Tensor,
                           sliding_window: int | None = None) -> MaskMod:
    """The element-wise mask: ``context_lens``/``seq_lens`` are ``[batch]`` int tensors."""

    def mask_mod(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor):
        return (kv_idx <= q_idx + context_lens[b]) & (kv_idx < seq_lens[b])

    if sliding_window is None:
        return mask_mod
    last_query = seq_lens - context_lens - 1  # [batch] index of each row's last real query

    def window_mask_mod(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor,
                        kv_idx: torch.Tensor):
        q_real = torch.minimum(q_idx, last_query[b])
        return mask_mod(b, h, q_idx, kv_idx) & (kv_idx > q_real + context_lens[b] - sliding_window)

    return window_mask_mod


def causal_prefix_block_mask(
    context_lens: torch.Tensor,  # [batch] int
    seq_lens: torch.Tensor,  # [batch] int
    q_len: int,
    kv_len: int,
    block_size: int = FLEX_BLOCK_SIZE,
    sliding_window: int | None = None,
) -> BlockMask:
    """The ``BlockMask`` of :func:`causal_prefix_mask_mod` for ``[batch, q_len] x [batch, kv_len]``.

    Tile ``(i, j)`` (queries ``i*block_size..``, keys ``j*block_size..``) is *full* when it lies
    inside ``q_len x kv_len`` and every pair in it is visible (FlexAttention then skips the mask
    function there), *partial* when some in-range pair is visible, and left out otherwise; a
    tile crossing ``q_len`` or ``kv_len`` is never full, as with ``create_block_mask``.
    Visibility only grows with ``q_idx`` and shrinks with ``kv_idx``, so a tile's corners decide;
    under a sliding window the lowest visible key only grows with ``q_idx`` too, and a query
    sees one contiguous run of keys, so the tile's corners still decide.
    """
    device = seq_lens.device
    num_q_blocks = -(-q_len // block_size)
    num_kv_blocks = -(-kv_len // block_size)
    q_first = torch.arange(num_q_blocks, device=device) * block_size  # [num_q_blocks]
    q_last = (q_first + block_size).clamp(max=q_len) - 1  # last in-range query of the tile
    kv_first = torch.arange(num_kv_blocks, device=device) * block_size  # [num_kv_blocks]
    kv_last = kv_first + block_size - 1  # [num_kv_blocks], may pass kv_len
    ctx = context_lens.to(device=device, dtype=torch.long)[:, None]  # [batch, 1]
    last_visible = (seq_lens.to(device=device, dtype=torch.long)[:, None] - 1)  # [batch, 1]
    # Highest key each tile row's first / last query may see.  [batch, num_q_blocks]
    bound_first = torch.minimum(q_first[None] + ctx, last_visible)
    bound_last = torch.minimum(q_last[None] + ctx, last_visible)
    # [batch, num_q_blocks, num_kv_blocks]
    any_visible = kv_first[None, None, :] <= bound_last[:, :, None]
    in_range = (q_first + block_size <= q_len)[:, None] & (kv_last < kv_len)[None, :]
    all_visible = (kv_last[None, None, :] <= bound_first[:, :, None]) & in_range[None]
    if sliding_window is not None:
        # Lowest key the tile row's first / last query sees (padded queries: the last real).
        last_query = (seq_lens.to(device=device, dtype=torch.long)[:, None] - ctx - 1)
        low_first = torch.minimum(q_first[None], last_query) + ctx - sliding_window + 1
        low_last = torch.minimum(q_last[None], last_query) + ctx - sliding_window + 1
        kv_last_in_range = kv_last.clamp(max=kv_len - 1)
        any_visible &= kv_last_in_range[None, None, :] >= low_first[:, :, None]
        all_visible &= kv_first[None, None, :] >= low_last[:, :, None]
    partial = any_visible & ~all_visible
    kv_num_blocks, kv_indices = _ordered(partial)
    full_num_blocks, full_indices = _ordered(all_visible)
    return BlockMask.from_kv_blocks(
        kv_num_blocks[:, None], kv_indices[:, None],  # add the (broadcast) head dimension
        full_num_blocks[:, None], full_indices[:, None],
        BLOCK_SIZE=block_size,
        mask_mod=causal_prefix_mask_mod(context_lens, seq_lens, sliding_window),
        seq_lengths=(q_len, kv_len),
    )


def _ordered(tiles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[..., n]`` bool -> (count of set tiles ``[...]`` int32, their indices first ``[..., n]`` int32)."""
    counts = tiles.sum(dim=-1, dtype=torch.int32)
    # A stable sort of "not set" puts the set tiles' indices first, in increasing order.
    indices = torch.argsort((~tiles).to(torch.uint8), dim=-1, stable=True).to(torch.int32)
    return counts, indices
