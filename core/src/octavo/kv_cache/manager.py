"""``KVCacheManager``: per-request block tables on top of the ``BlockPool``.

The scheduler talks to this class only: it asks which prefix of a request is already cached,
asks for slots for the tokens it wants to run this step, and frees a request's blocks. It never
sees the free queue.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from octavo.kv_cache.block_pool import BlockPool, KVCacheBlock

if TYPE_CHECKING:
    from octavo.engine.request import Request

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
        self.prefix_stats = PrefixCacheStats()
        # Blocks indexed by allocations of the step being scheduled: their KV is written when
        # the step runs. ``commit_step`` accepts them, ``discard_step`` un-indexes them.
        self._uncommitted: list[KVCacheBlock] = []

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
        # Index blocks that are full once this step has run (their tokens are known now).
        num_full = min(total_tokens // self.block_size, len(request.block_hashes))
        num_cached_before = num_computed // self.block_size
        self._uncommitted += self.block_pool.cache_full_blocks(
            blocks, request.block_hashes, num_cached_before, num_full
        )
        return [b.block_id for b in new_computed_blocks] + [b.block_id for b in new_blocks]

    def _fits_without_change(self, request: Request, num_new_tokens: int) -> bool:
        """Whether the request's blocks already hold ``num_new_tokens`` more tokens and none
        of its blocks fills up with them (so there is nothing to allocate or to index)."""
        blocks = self._req_blocks.get(request.request_id)
        if not blocks:
            return False
        num_computed = request.num_computed_tokens
        total_tokens = num_computed + num_new_tokens
        return (total_tokens <= len(blocks) * self.block_size
                and total_tokens // self.block_size == num_computed // self.block_size)

    def free(self, request: Request) -> None:
        """Release all blocks of a request; the tail goes back first so it is evicted first."""
        blocks = self._req_blocks.pop(request.request_id, None)
        if blocks:
            self.block_pool.free_blocks(reversed(blocks))

    def commit_step(self) -> None:
        """The last scheduled step ran: the blocks it filled hold valid KV."""
        self._uncommitted.clear()

    def discard_step(self) -> None:
        """The last scheduled step did not run (it raised): forget the prefixes it would have
        filled, so no later request reads their uncomputed slots as a cache hit."""
        self.block_pool.uncache(self._uncommitted)
        self._uncommitted.clear()

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self._req_blocks.get(request_id, [])]

    def num_requests_holding_blocks(self) -> int:
        return len(self._req_blocks)

    def reset_prefix_cache(self) -> bool:
        return self.block_pool.reset_prefix_cache()
