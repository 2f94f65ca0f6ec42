"""``KVCacheManager``: per-request block tables on top of the ``BlockPool``.

The scheduler talks to this class only: it asks which prefix of a request is already cached,
asks for slots for the tokens it wants to run this step, and frees a request's blocks. It never
sees the free queue.

Blocks are shared by reference count: prefix-cache hits, and requests forked from another
(``fork``: the completions of an n > 1 request, the beams of a beam search). A step that writes
into a shared block that is not full gets its own copy first (copy-on-write): the copy is
recorded for the workers (``take_block_copies``). Requests preempted by swapping move their
blocks to a second pool of host-memory blocks (``swap_out`` / ``swap_in``); the workers copy
the contents (``SchedulerOutput.blocks_to_swap_out`` / ``blocks_to_swap_in``).

Sliding window: when every attention layer of the model sees only the last ``sliding_window``
positions (``CacheConfig.sliding_window``), a running request's blocks that lie wholly before
the window of its next token are never read again; ``allocate_slots`` gives them back to the
pool (and does not take prefix-cache hits that lie there). The request's block list keeps a
placeholder in their place, so block ``i`` still holds positions ``i * block_size ..``; the
placeholder's id (``FREED_BLOCK_ID``) may reach the worker's block table, where the kernels
never read it. A freed block keeps its prefix hash like any free block: its KV stays valid
until the pool hands the block out again, which evicts the hash first, so a later prefix hit
on it reads what the hash names.

The freed placeholders compose with sharing and swapping: ``fork`` gives the child the same
placeholders (and shares only the live blocks), ``swap_out`` moves only the live blocks to host
blocks and ``swap_in`` brings them back behind the same placeholders, and ``free`` releases only
live blocks.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

from octavo.kv_cache.block_pool import BlockPool, KVCacheBlock

if TYPE_CHECKING:
    from octavo.messages.request import Request

logger = logging.getLogger(__name__)

# Block id shown for blocks freed as outside the sliding window (a real id, never read).
FREED_BLOCK_ID = 0
# Stands in a request's block list for a block freed as outside the sliding window.
_FREED = KVCacheBlock(block_id=FREED_BLOCK_ID)


@dataclass(slots=True)
class PrefixCacheStats:
    """Prefix-cache counters since the engine started (tokens, not blocks)."""

    # Prompt tokens looked up in the prefix cache.
    queries: int = 0
    # Of those, tokens found cached.
    hits: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class KVCacheManager:
    """Allocates, caches and frees the KV blocks of requests."""

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool,
                 sliding_window: int | None = None, num_host_blocks: int = 0) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        # Positions every layer sees before a token, itself included (None: all of them).
        self.sliding_window = sliding_window
        # Per request: how many of its leading blocks were freed as outside the window.
        self._num_freed: dict[str, int] = {}
        # Blocks freed as outside the window since the engine started.
        self.num_window_freed_blocks = 0
        self.block_pool = BlockPool(num_blocks, enable_caching)
        # Host-memory blocks of swapped-out requests (None: no swap space).
        self.host_pool = BlockPool(num_host_blocks, False) if num_host_blocks > 0 else None
        self._req_blocks: dict[str, list[KVCacheBlock]] = {}
        self._req_host_blocks: dict[str, list[KVCacheBlock]] = {}
        # Copy-on-write decided since the last take_block_copies(): (source, destination)
        # block ids, and per request the (index, new block id) of each replaced block.
        self._copies: list[tuple[int, int]] = []
        self._replaced: dict[str, list[tuple[int, int]]] = {}
        # Per request: how many of its leading blocks have been offered to the prefix index.
        # A block is offered once it is full and its tokens are known (with async scheduling
        # a block's last token may still be in flight when the block is allocated).
        self._num_indexed: dict[str, int] = {}
        # Per running request: the most tokens (computed + new) for which
        # fits_in_held_blocks is known to hold without looking again: the room in its blocks,
        # short of the next block to index, none of its blocks from the write position on
        # shared. Dropped when it forks (its blocks become shared), is swapped out or freed;
        # allocate_slots leaves it (its blocks and indexed blocks only grow: still true).
        self._decode_room: dict[str, int] = {}
        self.prefix_stats = PrefixCacheStats()
        # Blocks indexed by allocations of each step not yet known to have run, oldest step
        # first: their KV is written when the step runs. ``commit_step`` accepts the oldest
        # step's, ``discard_steps`` un-indexes them all.
        self._uncommitted: deque[list[KVCacheBlock]] = deque()

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    def usage(self) -> float:
        return self.block_pool.usage()

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest cached prefix of a waiting request: (blocks, number of tokens they hold).

        At least one token is always left to compute, so the step that finishes the prompt
        produces logits. Requests asking for prompt logprobs skip the cache (they need logits
        for every prompt token).
        """
        if not self.enable_caching or request.skip_prefix_cache:
            return [], 0
        # Leave the last token to compute: only blocks strictly before it may hit.
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVCacheBlock] = []
        for block_hash in request.block_hashes[:max_hit_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        num_hit_tokens = len(hits) * self.block_size
        if request.num_preemptions == 0:
            self.prefix_stats.queries += request.num_prompt_tokens
            self.prefix_stats.hits += min(num_hit_tokens, request.num_prompt_tokens)
        return hits, num_hit_tokens

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: list[KVCacheBlock] | None = None,
        num_new_computed_tokens: int = 0,
        num_lookahead_tokens: int = 0,
    ) -> list[int] | None:
        """Reserve slots for ``num_new_tokens`` tokens after the request's computed ones, and
        ``num_lookahead_tokens`` more past them (speculative decoding's draft model writes its
        KV there; they hold no known token, so they are never indexed).

        ``new_computed_blocks`` are prefix-cache hits (from ``get_computed_blocks``) being
        adopted now. Returns the ids of newly added blocks (hits included), or ``None`` when
        the pool cannot provide enough blocks — nothing is changed then, except that blocks
        wholly before the sliding window are freed either way (no later step reads them).
        """
        num_computed = request.num_computed_tokens + num_new_computed_tokens
        num_outside = self._blocks_before_window(num_computed)
        if num_outside:
            self._free_outside_window(request.request_id, num_outside)
        shared_index = self._shared_write_target(request)
        if (shared_index is None and not new_computed_blocks
                and self._fits_without_change(request, num_new_tokens, num_lookahead_tokens)):
            return []  # the common decode step: room in the last block, no block becomes full
        new_computed_blocks = new_computed_blocks or []
        blocks = self._req_blocks.setdefault(request.request_id, [])
        total_tokens = num_computed + num_new_tokens
        num_required = (self.blocks_needed(total_tokens + num_lookahead_tokens) - len(blocks)
                        - len(new_computed_blocks))
        # Hits wholly before the window are not taken: placeholders stand in for them.
        num_skipped_hits = min(len(new_computed_blocks), max(0, num_outside - len(blocks)))
        taken_hits = new_computed_blocks[num_skipped_hits:]
        # Hits sitting in the free queue stop being free once adopted.
        num_hits_in_queue = sum(1 for b in taken_hits if b.ref_cnt == 0)
        num_copies = 0 if shared_index is None else 1
        if max(num_required, 0) + num_copies > self.block_pool.num_free_blocks - num_hits_in_queue:
            if not blocks:
                del self._req_blocks[request.request_id]
            return None
        if shared_index is not None:
            self._copy_on_write(request.request_id, blocks, shared_index)
        self.block_pool.touch(taken_hits)
        if num_skipped_hits:
            blocks.extend([_FREED] * num_skipped_hits)
            self._num_freed[request.request_id] = len(blocks)
        blocks.extend(taken_hits)
        new_blocks = self.block_pool.get_new_blocks(max(num_required, 0))
        blocks.extend(new_blocks)
        # Index blocks that are full once this step has run and whose tokens are all known.
        num_full = min(total_tokens // self.block_size, len(request.block_hashes))
        # Freed blocks (placeholders) are not indexed again.
        num_indexed = max(self._num_indexed.get(request.request_id, 0),
                          self._num_freed.get(request.request_id, 0))
        if num_full > num_indexed:
            indexed = self.block_pool.cache_full_blocks(
                blocks, request.block_hashes, num_indexed, num_full
            )
            if indexed:
                if not self._uncommitted:
                    self._uncommitted.append([])
                self._uncommitted[-1] += indexed
            self._num_indexed[request.request_id] = num_full
        return ([FREED_BLOCK_ID] * num_skipped_hits + [b.block_id for b in taken_hits]
                + [b.block_id for b in new_blocks])

    def _blocks_before_window(self, num_computed: int) -> int:
        """Leading blocks wholly before the window of the token at position ``num_computed``
        (the next one to compute): never read again by this request."""
        if self.sliding_window is None:
            return 0
        first_visible = num_computed - self.sliding_window + 1
        return max(0, first_visible) // self.block_size

    def _free_outside_window(self, request_id: str, num_outside: int) -> None:
        """Free the request's blocks ``[already freed, num_outside)`` (those it holds)."""
        blocks = self._req_blocks.get(request_id)
        num_freed = self._num_freed.get(request_id, 0)
        end = min(num_outside, len(blocks)) if blocks else 0
        if end <= num_freed:
            return
        # Oldest first: the block furthest from the window is evicted first.
        self.block_pool.free_blocks(blocks[num_freed:end])
        blocks[num_freed:end] = [_FREED] * (end - num_freed)
        self._num_freed[request_id] = end
        self.num_window_freed_blocks += end - num_freed

    def _shared_write_target(self, request: Request) -> int | None:
        """Index of the block the request's next token is written into when that block is
        shared with another request and already holds tokens (so it must be copied first)."""
        blocks = self._req_blocks.get(request.request_id)
        offset = request.num_computed_tokens % self.block_size
        index = request.num_computed_tokens // self.block_size
        if not blocks or offset == 0 or index >= len(blocks):
            return None
        return index if blocks[index].ref_cnt > 1 else None

    def _copy_on_write(self, request_id: str, blocks: list[KVCacheBlock], index: int) -> None:
        """Give the request its own copy of its shared block ``index`` (one block must be free)."""
        shared = blocks[index]
        (own,) = self.block_pool.get_new_blocks(1)
        self.block_pool.free_blocks([shared])  # the other holders keep it
        blocks[index] = own
        self._copies.append((shared.block_id, own.block_id))
        self._replaced.setdefault(request_id, []).append((index, own.block_id))

    def take_block_copies(self) -> tuple[list[tuple[int, int]], dict[str, list[tuple[int, int]]]]:
        """The copies-on-write decided since the last call: ``(source, destination)`` block
        ids in order, and per request its replaced blocks ``(index, new block id)``."""
        copies, replaced = self._copies, self._replaced
        self._copies, self._replaced = [], {}
        return copies, replaced

    def fork(self, parent: Request, child: Request) -> None:
        """``child`` shares every live block of ``parent`` (one more reference each) and has
        placeholders where ``parent`` freed blocks outside the sliding window. Its next write
        into the last, partly filled block copies that block first (copy-on-write)."""
        assert child.request_id not in self._req_blocks, f"{child.request_id} already has blocks"
        self._decode_room.pop(parent.request_id, None)  # its blocks become shared
        blocks = self._req_blocks.get(parent.request_id, [])
        num_freed = self._num_freed.get(parent.request_id, 0)
        self.block_pool.touch(blocks[num_freed:])
        self._req_blocks[child.request_id] = list(blocks)
        if num_freed:
            self._num_freed[child.request_id] = num_freed
        self._num_indexed[child.request_id] = self._num_indexed.get(parent.request_id, 0)

    def num_blocks_to_allocate(self, request: Request, num_new_tokens: int,
                               num_lookahead_tokens: int = 0) -> int:
        """Blocks ``allocate_slots(request, num_new_tokens, ...num_lookahead_tokens)`` would
        take from the pool now (a request that holds blocks; no prefix hits): new ones plus a
        copy-on-write, less the blocks it first gives back as outside the sliding window (0 at
        least)."""
        blocks = self._req_blocks.get(request.request_id, [])
        total = request.num_computed_tokens + num_new_tokens + num_lookahead_tokens
        num_copies = 0 if self._shared_write_target(request) is None else 1
        num_new = max(self.blocks_needed(total) - len(blocks), 0) + num_copies
        end = min(self._blocks_before_window(request.num_computed_tokens), len(blocks))
        # Only blocks no other request holds return to the pool.
        num_released = sum(1 for b in blocks[self._num_freed.get(request.request_id, 0):end]
                           if b.ref_cnt == 1)
        return max(num_new - num_released, 0)

    # ---- swapping to host memory -------------------------------------------------------

    @property
    def num_host_blocks(self) -> int:
        return self.host_pool.num_blocks if self.host_pool is not None else 0

    @property
    def num_free_host_blocks(self) -> int:
        return self.host_pool.num_free_blocks if self.host_pool is not None else 0

    def host_usage(self) -> float:
        """Fraction of host blocks holding swapped-out requests (0 without swap space)."""
        return self.host_pool.usage() if self.host_pool is not None else 0.0

    def num_blocks_held(self, request: Request) -> int:
        """Device blocks the request holds (placeholders of freed blocks not counted)."""
        blocks = self._req_blocks.get(request.request_id, [])
        return len(blocks) - self._num_freed.get(request.request_id, 0) if blocks else 0

    def can_swap_out(self, requests: list[Request]) -> bool:
        """Whether the host pool has room for every block of ``requests``."""
        needed = sum(self.num_blocks_held(r) for r in requests)
        return self.host_pool is not None and needed <= self.host_pool.num_free_blocks

    def swap_out(self, request: Request) -> list[tuple[int, int]]:
        """Move the request's blocks to host blocks (the caller checked ``can_swap_out``):
        its device blocks are released (tail first); returns the (device block, host block)
        pairs whose contents the workers must copy before any of them is reused. Blocks freed
        as outside the sliding window stay freed (the request keeps its ``_num_freed``)."""
        assert self.host_pool is not None, "no swap space"
        blocks = self._req_blocks.pop(request.request_id, [])
        blocks = blocks[self._num_freed.get(request.request_id, 0):]
        self._num_indexed.pop(request.request_id, None)
        self._decode_room.pop(request.request_id, None)
        host_blocks = self.host_pool.get_new_blocks(len(blocks))
        self._req_host_blocks[request.request_id] = host_blocks
        self.block_pool.free_blocks(reversed(blocks))
        return [(b.block_id, h.block_id) for b, h in zip(blocks, host_blocks)]

    def num_blocks_to_swap_in(self, request: Request, num_new_tokens: int) -> int:
        """Device blocks a swapped request needs back, plus those for ``num_new_tokens``."""
        num_host = len(self._req_host_blocks.get(request.request_id, []))
        num_freed = self._num_freed.get(request.request_id, 0)
        total = request.num_computed_tokens + num_new_tokens
        return max(num_freed + num_host, self.blocks_needed(total)) - num_freed

    def swap_in(self, request: Request) -> list[tuple[int, int]]:
        """Give a swapped request device blocks for its host blocks (the caller checked there
        are enough free); returns the (host block, device block) pairs to copy. Its host
        blocks are released: the copy runs before anything can reuse them (the next step)."""
        assert self.host_pool is not None, "no swap space"
        host_blocks = self._req_host_blocks.pop(request.request_id)
        blocks = self.block_pool.get_new_blocks(len(host_blocks))
        num_freed = self._num_freed.get(request.request_id, 0)
        self._req_blocks[request.request_id] = [_FREED] * num_freed + blocks
        self.host_pool.free_blocks(host_blocks)
        return [(h.block_id, b.block_id) for h, b in zip(host_blocks, blocks)]

    def is_swapped(self, request: Request) -> bool:
        return request.request_id in self._req_host_blocks

    def fits_in_held_blocks(self, request: Request, num_new_tokens: int) -> bool:
        """Whether ``allocate_slots(request, num_new_tokens)`` would change nothing and return
        ``[]`` (no block to take, copy, index or free: the common decode step), so a caller may
        skip it; ``num_blocks_to_allocate`` is then 0. A cheap check, made for every running
        request every step (most of the time one lookup of the room it found last time)."""
        num_computed = request.num_computed_tokens
        total_tokens = num_computed + num_new_tokens
        req_id = request.request_id
        if total_tokens <= self._decode_room.get(req_id, -1):
            return True
        if self.sliding_window is not None:
            return False
        blocks = self._req_blocks.get(req_id)
        if not blocks:
            return False
        block_size = self.block_size
        if total_tokens > len(blocks) * block_size:
            return False
        num_indexed = self._num_indexed.get(req_id, 0)
        # A block to index: min(num_full, len(block_hashes)) > num_indexed.
        num_full = total_tokens // block_size
        if num_full > num_indexed and len(request.block_hashes) > num_indexed:
            return False
        # A write into a block shared with another request copies it first.
        first_written = num_computed // block_size
        if num_computed % block_size and blocks[first_written].ref_cnt > 1:
            return False
        if all(block.ref_cnt == 1 for block in blocks[first_written:]):
            self._decode_room[req_id] = min(len(blocks) * block_size,
                                            (num_indexed + 1) * block_size - 1)
        return True

    def _fits_without_change(self, request: Request, num_new_tokens: int,
                             num_lookahead_tokens: int = 0) -> bool:
        """Whether the request's blocks already hold ``num_new_tokens`` (and the lookahead)
        more tokens and no block is left to index (so there is nothing to allocate or to
        index)."""
        blocks = self._req_blocks.get(request.request_id)
        if not blocks:
            return False
        total_tokens = request.num_computed_tokens + num_new_tokens
        if total_tokens + num_lookahead_tokens > len(blocks) * self.block_size:
            return False
        num_full = min(total_tokens // self.block_size, len(request.block_hashes))
        return num_full <= self._num_indexed.get(request.request_id, 0)

    def free(self, request: Request) -> None:
        """Release all blocks of a request (device blocks tail first, so they are evicted
        first; host blocks of a swapped request too)."""
        blocks = self._req_blocks.pop(request.request_id, None)
        self._num_indexed.pop(request.request_id, None)
        self._decode_room.pop(request.request_id, None)
        num_freed = self._num_freed.pop(request.request_id, 0)
        if blocks:
            self.block_pool.free_blocks(reversed(blocks[num_freed:]))
        host_blocks = self._req_host_blocks.pop(request.request_id, None)
        if host_blocks:
            assert self.host_pool is not None
            self.host_pool.free_blocks(host_blocks)

    def begin_step(self) -> None:
        """Allocations from now on belong to a new step (scheduled, not yet run)."""
        self._uncommitted.append([])

    def cancel_empty_step(self) -> None:
        """The step begun last scheduled nothing (so allocated nothing): drop its record."""
        if self._uncommitted:
            assert not self._uncommitted[-1], "a step that allocated blocks is not empty"
            self._uncommitted.pop()

    def commit_step(self) -> None:
        """The oldest step not yet committed ran: the blocks it filled hold valid KV."""
        if self._uncommitted:
            self._uncommitted.popleft()

    def discard_steps(self) -> None:
        """No step scheduled since the last commit ran (one raised): forget the prefixes they
        would have filled, so no later request reads uncomputed slots as a cache hit."""
        for blocks in self._uncommitted:
            self.block_pool.uncache(blocks)
        self._uncommitted.clear()

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self._req_blocks.get(request_id, [])]

    def num_requests_holding_blocks(self) -> int:
        """Requests holding device or host blocks."""
        return len(self._req_blocks) + len(self._req_host_blocks)

    def reset_prefix_cache(self) -> bool:
        return self.block_pool.reset_prefix_cache()
