"""The pool of fixed-size KV blocks: reference counts, free queue, prefix-hash index.

Free blocks wait in a doubly linked queue in eviction order: the head is evicted first. A free
block may still hold a cached prefix (it keeps its hash until it is reused), so a later request
with the same prefix can take it back from the middle of the queue in O(1).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from octavo.kv_cache.hashing import BlockHash


@dataclass(slots=True, eq=False)
class KVCacheBlock:
    """One block of ``block_size`` token slots in every layer's KV cache."""

    # Index into the KV cache tensors.
    block_id: int
    # Number of requests using the block; 0 means it is in the free queue.
    ref_cnt: int = 0
    # Hash of the full block's prefix when the block is cached, else None.
    block_hash: BlockHash | None = None
    # Neighbours in the free queue (None when not queued or at an end).
    prev_free: KVCacheBlock | None = None
    next_free: KVCacheBlock | None = None


class FreeBlockQueue:
    """Doubly linked list of free blocks; O(1) pop from the head, append and removal."""

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(block_id=-1)
        self._tail = KVCacheBlock(block_id=-2)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free
        if block is self._tail or block is None:
            raise ValueError("no free blocks left")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        assert block.prev_free is not None and block.next_free is not None, (
            f"block {block.block_id} is not in the free queue"
        )
        block.prev_free.next_free = block.next_free
        block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        last = self._tail.prev_free
        assert last is not None
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free_blocks += 1

    def block_ids(self) -> list[int]:
        """Ids in eviction order (for tests and debugging)."""
        ids = []
        node = self._head.next_free
        while node is not None and node is not self._tail:
            ids.append(node.block_id)
            node = node.next_free
        return ids


class BlockPool:
    """Owns every ``KVCacheBlock``; hands them out, takes them back, indexes cached ones."""

    def __init__(self, num_blocks: int, enable_caching: bool) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(block_id=i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self._cached: dict[BlockHash, KVCacheBlock] = {}

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free_blocks

    def usage(self) -> float:
        """Fraction of blocks in use by requests (cached free blocks count as free)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        return self._cached.get(block_hash)

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take ``num_blocks`` blocks from the head of the free queue (evicting cached ones)."""
        if num_blocks > self.num_free_blocks:
            raise ValueError(f"asked for {num_blocks} blocks, {self.num_free_blocks} free")
        blocks = []
        for _ in range(num_blocks):
            block = self.free_queue.popleft()
            self._evict(block)
            block.ref_cnt = 1
            blocks.append(block)
        return blocks

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take another reference to cache-hit blocks (pulling free ones out of the queue)."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def cache_full_blocks(
        self, blocks: list[KVCacheBlock], block_hashes: list[BlockHash], start: int, end: int
    ) -> list[KVCacheBlock]:
        """Index blocks ``start..end-1`` of a request (now full) under their prefix hashes.

        Returns the blocks newly indexed (so a step that never ran can ``uncache`` them).
        """
        if not self.enable_caching:
            return []
        indexed = []
        for i in range(start, end):
            block = blocks[i]
            if block.block_hash is not None:
                continue  # a cache hit, already indexed
            block_hash = block_hashes[i]
            if block_hash in self._cached:
                continue  # the same prefix was computed twice; keep the first copy indexed
            block.block_hash = block_hash
            self._cached[block_hash] = block
            indexed.append(block)
        return indexed

    def uncache(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Forget the prefix hashes of ``blocks`` (their contents were never computed)."""
        for block in blocks:
            self._evict(block)

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference to each block; blocks reaching 0 join the queue in this order."""
        for block in ordered_blocks:
            assert block.ref_cnt > 0, f"block {block.block_id} freed more often than taken"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue.append(block)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix; only possible when no block is in use."""
        if self.num_free_blocks != self.num_blocks:
            return False
        for block in self.blocks:
            block.block_hash = None
        self._cached.clear()
        return True

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is None:
            return
        if self._cached.get(block.block_hash) is block:
            del self._cached[block.block_hash]
        block.block_hash = None
