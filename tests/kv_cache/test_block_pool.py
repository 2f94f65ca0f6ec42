"""``BlockPool`` and its ``FreeBlockQueue``: free counts, ref counts, links, eviction order."""

from __future__ import annotations

import pytest
from octavo.kv_cache.block_pool import BlockPool, FreeBlockQueue, KVCacheBlock
from octavo.kv_cache.hashing import hash_block_tokens


def queue_ids_backward(queue: FreeBlockQueue) -> list[int]:
    """Ids from the tail to the head, following ``prev_free`` links."""
    ids = []
    node = queue._tail.prev_free
    while node is not None and node is not queue._head:
        ids.append(node.block_id)
        node = node.prev_free
    return ids


def check_queue(pool: BlockPool) -> list[int]:
    """Assert the queue's invariants and return its ids in eviction order."""
    forward = pool.free_queue.block_ids()
    assert queue_ids_backward(pool.free_queue) == forward[::-1], "prev/next links disagree"
    assert len(forward) == pool.num_free_blocks == len(set(forward))
    for block in pool.blocks:
        queued = block.block_id in forward
        assert queued == (block.ref_cnt == 0), f"block {block.block_id}: ref {block.ref_cnt}"
        if not queued:
            assert block.prev_free is None and block.next_free is None
    return forward


def cache(pool: BlockPool, blocks: list[KVCacheBlock], tokens_per_block: list[list[int]]) -> list:
    """Index ``blocks`` under the chained hashes of ``tokens_per_block``; return the hashes."""
    hashes, parent = [], None
    for tokens in tokens_per_block:
        parent = hash_block_tokens(parent, tokens)
        hashes.append(parent)
    pool.cache_full_blocks(blocks, hashes, 0, len(blocks))
    return hashes


def test_new_pool_is_all_free_in_id_order() -> None:
    pool = BlockPool(6, enable_caching=True)
    assert check_queue(pool) == [0, 1, 2, 3, 4, 5]
    assert pool.num_free_blocks == 6 and pool.usage() == 0.0
    assert all(b.ref_cnt == 0 and b.block_hash is None for b in pool.blocks)


def test_needs_a_block() -> None:
    with pytest.raises(ValueError, match="at least one block, got 0"):
        BlockPool(0, enable_caching=True)


def test_get_new_blocks_pops_the_head_and_counts() -> None:
    pool = BlockPool(5, enable_caching=True)
    blocks = pool.get_new_blocks(2)
    assert [b.block_id for b in blocks] == [0, 1]
    assert [b.ref_cnt for b in blocks] == [1, 1]
    assert check_queue(pool) == [2, 3, 4]
    assert pool.usage() == pytest.approx(2 / 5)


def test_asking_too_many_changes_nothing() -> None:
    pool = BlockPool(3, enable_caching=True)
    pool.get_new_blocks(1)
    with pytest.raises(ValueError, match="asked for 3 blocks, 2 free"):
        pool.get_new_blocks(3)
    assert check_queue(pool) == [1, 2]


def test_free_appends_in_the_given_order() -> None:
    pool = BlockPool(4, enable_caching=True)
    blocks = pool.get_new_blocks(4)
    pool.free_blocks([blocks[2], blocks[0]])
    assert check_queue(pool) == [2, 0]
    pool.free_blocks([blocks[3], blocks[1]])
    assert check_queue(pool) == [2, 0, 3, 1]
    with pytest.raises(AssertionError, match="freed more often than taken"):
        pool.free_blocks([blocks[0]])


def test_shared_block_returns_only_with_its_last_reference() -> None:
    pool = BlockPool(3, enable_caching=True)
    (block,) = pool.get_new_blocks(1)
    pool.touch([block])  # a second request hits it
    assert block.ref_cnt == 2 and check_queue(pool) == [1, 2]
    pool.free_blocks([block])
    assert block.ref_cnt == 1 and check_queue(pool) == [1, 2]
    pool.free_blocks([block])
    assert block.ref_cnt == 0 and check_queue(pool) == [1, 2, 0]


def test_cache_hit_removes_a_free_block_from_the_middle_in_place() -> None:
    pool = BlockPool(5, enable_caching=True)
    blocks = pool.get_new_blocks(5)
    hashes = cache(pool, blocks[:3], [[1, 2], [3, 4], [5, 6]])
    pool.free_blocks(blocks)  # queue 0 1 2 3 4
    middle = pool.get_cached_block(hashes[1])
    assert middle is blocks[1]
    before, after = middle.prev_free, middle.next_free
    pool.touch([middle])
    # O(1) unlink: only the neighbours' links change.
    assert before.next_free is after and after.prev_free is before
    assert middle.ref_cnt == 1 and middle.prev_free is None and middle.next_free is None
    assert check_queue(pool) == [0, 2, 3, 4]
    # Still cached while in use.
    assert pool.get_cached_block(hashes[1]) is middle and middle.block_hash == hashes[1]


def test_touch_of_a_block_in_use_only_counts() -> None:
    pool = BlockPool(3, enable_caching=True)
    (block,) = pool.get_new_blocks(1)
    pool.touch([block])
    pool.touch([block])
    assert block.ref_cnt == 3 and check_queue(pool) == [1, 2]


def test_reuse_evicts_cached_blocks_least_recently_used_first() -> None:
    pool = BlockPool(4, enable_caching=True)
    a, b, c, d = pool.get_new_blocks(4)
    ha, hb, hc = (hash_block_tokens(None, [i]) for i in (10, 20, 30))
    pool.cache_full_blocks([a, b, c], [ha, hb, hc], 0, 3)
    pool.free_blocks([a, b, c, d])  # queue a b c d
    pool.touch([a])  # a is used again ...
    pool.free_blocks([a])  # ... and freed last: now the most recently used
    assert check_queue(pool) == [b.block_id, c.block_id, d.block_id, a.block_id]
    (first,) = pool.get_new_blocks(1)
    assert first is b
    assert b.block_hash is None and pool.get_cached_block(hb) is None  # evicted
    assert pool.get_cached_block(ha) is a and pool.get_cached_block(hc) is c
    second, third = pool.get_new_blocks(2)
    assert (second, third) == (c, d)
    assert pool.get_cached_block(hc) is None and pool.get_cached_block(ha) is a


def test_same_prefix_computed_twice_keeps_the_first_copy_indexed() -> None:
    pool = BlockPool(2, enable_caching=True)
    x, y = pool.get_new_blocks(2)
    h = hash_block_tokens(None, [1, 2, 3])
    pool.cache_full_blocks([x], [h], 0, 1)
    pool.cache_full_blocks([y], [h], 0, 1)
    assert pool.get_cached_block(h) is x and y.block_hash is None
    pool.free_blocks([x, y])
    # Evicting the unindexed copy must not drop the indexed one.
    assert pool.get_new_blocks(1)[0] is x
    assert pool.get_cached_block(h) is None


def test_caching_disabled_indexes_nothing() -> None:
    pool = BlockPool(2, enable_caching=False)
    blocks = pool.get_new_blocks(1)
    hashes = cache(pool, blocks, [[1, 2]])
    assert pool.get_cached_block(hashes[0]) is None and blocks[0].block_hash is None


def test_reset_prefix_cache() -> None:
    pool = BlockPool(3, enable_caching=True)
    blocks = pool.get_new_blocks(2)
    hashes = cache(pool, blocks, [[1], [2]])
    assert pool.reset_prefix_cache() is False  # blocks in use: nothing is forgotten
    assert pool.get_cached_block(hashes[0]) is blocks[0]
    pool.free_blocks(blocks)
    assert pool.reset_prefix_cache() is True
    assert all(pool.get_cached_block(h) is None for h in hashes)
    assert all(b.block_hash is None for b in pool.blocks)
    assert check_queue(pool) == [2, 0, 1]  # the queue itself is untouched


def test_uncache_forgets_only_the_blocks_own_entry() -> None:
    pool = BlockPool(3, enable_caching=True)
    x, y = pool.get_new_blocks(2)
    h = hash_block_tokens(None, [4, 5])
    assert pool.cache_full_blocks([x], [h], 0, 1) == [x]
    assert pool.cache_full_blocks([y], [h], 0, 1) == []  # duplicate: not indexed
    pool.uncache([y])
    assert pool.get_cached_block(h) is x
    pool.uncache([x])
    assert pool.get_cached_block(h) is None and x.block_hash is None
    assert x.ref_cnt == 1 and check_queue(pool) == [2]  # references are not touched
