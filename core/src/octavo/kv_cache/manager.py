"""``KVCacheManager``: per-request block tables on top of the ``BlockPool``.

The scheduler talks to this class only: it asks which prefix of a request is already cached,
asks for slots for the tokens it wants to run this step, and frees a request's blocks. It never
sees the free queue.
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

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks, enable_caching)
        self._req_blocks: dict[str, list[KVCacheBlock]] = {}
        # Per request: how many of its leading blocks have been offered to the prefix index.
        # A block is offered once it is full and its tokens are known (with async scheduling
        # a block's last token may still be in flight when the block is allocated).
        self._num_indexed: dict[str, int] = {}
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
    ) -> list[int] | None:
        """Reserve slots for ``num_new_tokens`` tokens after the request's computed ones.

        ``new_computed_blocks`` are prefix-cache hits (from ``get_computed_blocks``) being
        adopted now. Returns the ids of newly added blocks (hits included), or ``None`` when
        the pool cannot provide enough blocks — nothing is changed then.
        """
        if not new_computed_blocks and self._fits_without_change(request, num_new_tokens):
            return []  # the common decode step: room in the last block, no block becomes full
        new_computed_blocks = new_computed_blocks or []
        blocks = self._req_blocks.setdefault(request.request_id, [])
        num_computed = request.num_computed_tokens + num_new_computed_tokens
        total_tokens = num_computed + num_new_tokens
        num_required = self.blocks_needed(total_tokens) - len(blocks) - len(new_computed_blocks)
        # Hits sitting in the free queue stop being free once adopted.
        num_hits_in_queue = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if max(num_required, 0) > self.block_pool.num_free_blocks - num_hits_in_queue:
            if not blocks:
                del self._req_blocks[request.request_id]
            return None
        self.block_pool.touch(new_computed_blocks)
        blocks.extend(new_computed_blocks)
        new_blocks = self.block_pool.get_new_blocks(max(num_required, 0))
        blocks.extend(new_blocks)
        # Index blocks that are full once this step has run and whose tokens are all known.
        num_full = min(total_tokens // self.block_size, len(request.block_hashes))
        num_indexed = self._num_indexed.get(request.request_id, 0)
        if num_full > num_indexed:
            indexed = self.block_pool.cache_full_blocks(
                blocks, request.block_hashes, num_indexed, num_full
            )
            if indexed:
                if not self._uncommitted:
                    self._uncommitted.append([])
                self._uncommitted[-1] += indexed
            self._num_indexed[request.request_id] = num_full
        return [b.block_id for b in new_computed_blocks] + [b.block_id for b in new_blocks]

    def _fits_without_change(self, request: Request, num_new_tokens: int) -> bool:
        """Whether the request's blocks already hold ``num_new_tokens`` more tokens and no
        block is left to index (so there is nothing to allocate or to index)."""
        blocks = self._req_blocks.get(request.request_id)
        if not blocks:
            return False
        total_tokens = request.num_computed_tokens + num_new_tokens
        if total_tokens > len(blocks) * self.block_size:
            return False
        num_full = min(total_tokens // self.block_size, len(request.block_hashes))
        return num_full <= self._num_indexed.get(request.request_id, 0)

    def free(self, request: Request) -> None:
        """Release all blocks of a request; the tail goes back first so it is evicted first."""
        blocks = self._req_blocks.pop(request.request_id, None)
        self._num_indexed.pop(request.request_id, None)
        if blocks:
            self.block_pool.free_blocks(reversed(blocks))

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
        return len(self._req_blocks)

    def reset_prefix_cache(self) -> bool:
        return self.block_pool.reset_prefix_cache()
