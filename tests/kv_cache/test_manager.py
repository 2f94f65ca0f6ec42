"""``KVCacheManager``: block tables, prefix-cache hits (chained hashes), all-or-nothing allocation."""

from __future__ import annotations

from octavo.kv_cache.hashing import block_hasher, hash_block_tokens
from octavo.kv_cache.manager import KVCacheManager
from octavo.messages import Request
from octavo.sampling_params import SamplingParams

BS = 4


def make_request(req_id: str, prompt: list[int], **params) -> Request:
    params.setdefault("max_tokens", 8)
    return Request(req_id, prompt, SamplingParams(**params), block_hasher=block_hasher(BS))


def run_prompt(manager: KVCacheManager, request: Request) -> list[int]:
    """Schedule a request's whole prompt (after its cached prefix), as the scheduler does."""
    hits, num_hit = manager.get_computed_blocks(request)
    ids = manager.allocate_slots(request, request.num_tokens - num_hit, hits, num_hit)
    assert ids is not None
    request.num_computed_tokens = request.num_tokens
    return ids


def test_allocate_and_free() -> None:
    manager = KVCacheManager(8, BS, enable_caching=True)
    request = make_request("a", list(range(10, 20)))  # 10 tokens -> 3 blocks
    ids = run_prompt(manager, request)
    assert ids == [0, 1, 2] and manager.get_block_ids("a") == [0, 1, 2]
    assert manager.num_free_blocks == 5 and manager.num_requests_holding_blocks() == 1
    # Decode: 2 more tokens fit the third block, the 13th needs a fourth.
    assert manager.allocate_slots(request, 2) == []
    request.num_computed_tokens = 12
    assert manager.allocate_slots(request, 1) == [3]
    manager.free(request)
    assert manager.num_free_blocks == 8 and manager.num_requests_holding_blocks() == 0
    assert manager.get_block_ids("a") == []
    # The tail goes back first, so it is evicted first.
    assert manager.block_pool.free_queue.block_ids() == [4, 5, 6, 7, 3, 2, 1, 0]
    manager.free(request)  # a second free is a no-op
    assert manager.num_free_blocks == 8


def test_prefix_hit_shares_full_blocks() -> None:
    manager = KVCacheManager(8, BS, enable_caching=True)
    prompt = list(range(100, 110))  # 2 full blocks + 2 tokens
    a = make_request("a", prompt)
    run_prompt(manager, a)
    b = make_request("b", prompt[:8] + [7, 7, 7])
    hits, num_hit = manager.get_computed_blocks(b)
    assert [blk.block_id for blk in hits] == manager.get_block_ids("a")[:2] and num_hit == 8
    assert manager.allocate_slots(b, b.num_tokens - num_hit, hits, num_hit) == [0, 1, 3]
    assert [blk.ref_cnt for blk in hits] == [2, 2]
    manager.free(a)
    assert [blk.ref_cnt for blk in hits] == [1, 1]
    assert manager.num_free_blocks == 8 - 3  # b still holds 0, 1 and 3
    assert manager.prefix_stats.queries == 10 + 11 and manager.prefix_stats.hits == 8


def test_hit_on_a_free_cached_block_takes_it_out_of_the_queue() -> None:
    manager = KVCacheManager(4, BS, enable_caching=True)
    prompt = list(range(50, 59))
    a = make_request("a", prompt)
    run_prompt(manager, a)
    manager.free(a)
    assert manager.num_free_blocks == 4
    b = make_request("b", prompt)
    ids = run_prompt(manager, b)
    assert ids[:2] == [0, 1]  # the same blocks, not recomputed
    assert manager.num_free_blocks == 4 - 3
    assert 0 not in manager.block_pool.free_queue.block_ids()


def test_same_block_after_a_different_prefix_does_not_hit() -> None:
    manager = KVCacheManager(8, BS, enable_caching=True)
    shared_block = [5, 6, 7, 8]
    a = make_request("a", [1, 2, 3, 4] + shared_block + [9])
    run_prompt(manager, a)
    b = make_request("b", [4, 3, 2, 1] + shared_block + [9])
    # The second blocks hold the same tokens, but their chained hashes differ.
    assert a.block_hashes[1] != b.block_hashes[1]
    assert b.block_hashes[1] != hash_block_tokens(None, shared_block)
    assert manager.block_pool.get_cached_block(b.block_hashes[1]) is None
    assert manager.get_computed_blocks(b) == ([], 0)


def test_fully_cached_prompt_leaves_one_token_to_compute() -> None:
    manager = KVCacheManager(8, BS, enable_caching=True)
    prompt = list(range(20, 29))  # 9 tokens: 2 full blocks + 1
    run_prompt(manager, make_request("a", prompt))
    hits, num_hit = manager.get_computed_blocks(make_request("b", prompt))
    assert len(hits) == 2 and num_hit == 8  # the 9th token is computed
    # Block-aligned prompt: the last full block is not taken, so its last token is computed.
    aligned = list(range(40, 48))
    run_prompt(manager, make_request("c", aligned))
    hits, num_hit = manager.get_computed_blocks(make_request("d", aligned))
    assert len(hits) == 1 and num_hit == 4


def test_prompt_logprobs_requests_skip_the_cache() -> None:
    manager = KVCacheManager(8, BS, enable_caching=True)
    prompt = list(range(20, 29))
    run_prompt(manager, make_request("a", prompt))
    assert manager.get_computed_blocks(make_request("b", prompt, prompt_logprobs=1)) == ([], 0)
    assert manager.get_computed_blocks(make_request("c", prompt))[1] == 8


def test_caching_disabled_never_hits() -> None:
    manager = KVCacheManager(8, BS, enable_caching=False)
    prompt = list(range(20, 29))
    run_prompt(manager, make_request("a", prompt))
    assert manager.get_computed_blocks(make_request("b", prompt)) == ([], 0)


def test_failed_allocation_changes_nothing() -> None:
    manager = KVCacheManager(5, BS, enable_caching=True)
    prompt = list(range(60, 69))  # 3 blocks
    a = make_request("a", prompt)
    run_prompt(manager, a)
    manager.free(a)
    filler = make_request("filler", [1, 1])
    assert manager.allocate_slots(filler, 2) is not None  # takes block 3
    # b hits a's 2 cached free blocks and needs 3 more for 12 new tokens; only 2 are left.
    b = make_request("b", prompt[:8] + list(range(200, 212)))
    hits, num_hit = manager.get_computed_blocks(b)
    assert num_hit == 8
    queue_before = manager.block_pool.free_queue.block_ids()
    refs_before = [blk.ref_cnt for blk in manager.block_pool.blocks]
    assert manager.allocate_slots(b, b.num_tokens - num_hit, hits, num_hit) is None
    assert manager.block_pool.free_queue.block_ids() == queue_before
    assert [blk.ref_cnt for blk in manager.block_pool.blocks] == refs_before
    assert manager.get_block_ids("b") == [] and manager.num_requests_holding_blocks() == 1
    assert manager.block_pool.get_cached_block(b.block_hashes[0]) is hits[0]  # still cached
    # A running request that cannot grow keeps what it had.
    held = manager.get_block_ids("filler")
    filler.num_computed_tokens = 2
    assert manager.allocate_slots(filler, 5 * BS) is None
    assert manager.get_block_ids("filler") == held and manager.num_free_blocks == 4


def test_blocks_are_indexed_once_full() -> None:
    manager = KVCacheManager(8, BS, enable_caching=True)
    request = make_request("a", [1, 2, 3, 4, 5, 6])
    run_prompt(manager, request)
    pool = manager.block_pool
    assert pool.get_cached_block(request.block_hashes[0]) is not None
    assert len(request.block_hashes) == 1  # the second block is not full yet
    for token in (7, 8):  # two decode steps fill the second block
        request.append_output_token(token)
        assert manager.allocate_slots(request, 1) == []
        request.num_computed_tokens += 1
    assert len(request.block_hashes) == 2
    second = pool.get_cached_block(request.block_hashes[1])
    assert second is not None and second.block_id == manager.get_block_ids("a")[1]


def test_discard_step_forgets_prefixes_the_step_would_have_filled() -> None:
    manager = KVCacheManager(8, BS, enable_caching=True)
    done = make_request("done", list(range(30, 39)))
    run_prompt(manager, done)
    manager.commit_step()  # its step ran
    lost = make_request("lost", list(range(30, 34)) + list(range(70, 78)))
    hits, num_hit = manager.get_computed_blocks(lost)
    assert num_hit == 4
    manager.allocate_slots(lost, lost.num_tokens - num_hit, hits, num_hit)
    assert manager.block_pool.get_cached_block(lost.block_hashes[1]) is not None
    manager.discard_steps()  # its step raised: blocks 1 and 2 of "lost" were never written
    pool = manager.block_pool
    assert pool.get_cached_block(lost.block_hashes[1]) is None
    assert pool.get_cached_block(lost.block_hashes[2]) is None
    # Prefixes computed by earlier steps stay cached.
    assert pool.get_cached_block(done.block_hashes[0]) is not None
    assert pool.get_cached_block(done.block_hashes[1]) is not None


# ---- sliding window: blocks wholly before the window of the next token are freed ---------------


def decode(manager: KVCacheManager, request: Request, token: int) -> list[int] | None:
    """One decode step of ``request`` (its sampled ``token`` recorded first)."""
    request.append_output_token(token)
    ids = manager.allocate_slots(request, 1)
    request.num_computed_tokens += 1
    return ids


def test_window_frees_blocks_before_the_next_tokens_window() -> None:
    from octavo.kv_cache.manager import FREED_BLOCK_ID

    manager = KVCacheManager(10, BS, enable_caching=True, sliding_window=6)
    request = make_request("a", list(range(10, 20)))  # 10 tokens, blocks 0..2
    run_prompt(manager, request)
    assert manager.num_free_blocks == 7
    # Next token at position 10 sees positions 5..10: block 0 (positions 0..3) is outside.
    decode(manager, request, 1)
    assert manager.num_free_blocks == 8 and manager.num_window_freed_blocks == 1
    assert manager.get_block_ids("a") == [FREED_BLOCK_ID, 1, 2]
    # Positions 4..7 (block 1) leave the window once the next token is at 13.
    for token in (2, 3):
        decode(manager, request, token)  # positions 11, 12; 12 needs block 3
    assert manager.num_free_blocks == 7
    assert manager.get_block_ids("a") == [FREED_BLOCK_ID, 1, 2, 3]
    decode(manager, request, 4)  # position 13 sees 8..13
    assert manager.get_block_ids("a") == [FREED_BLOCK_ID, FREED_BLOCK_ID, 2, 3]
    assert manager.num_free_blocks == 8 and manager.num_window_freed_blocks == 2
    # Every block comes back, once: the freed ones are not freed twice.
    manager.free(request)
    assert manager.num_free_blocks == 10 and manager.num_requests_holding_blocks() == 0
    assert all(b.ref_cnt == 0 for b in manager.block_pool.blocks)


def test_window_freeing_needs_a_window() -> None:
    manager = KVCacheManager(10, BS, enable_caching=True)  # no window: nothing freed early
    request = make_request("a", list(range(10, 30)))
    run_prompt(manager, request)
    for token in range(5):
        decode(manager, request, token)
    assert manager.num_window_freed_blocks == 0 and 0 not in manager.get_block_ids("a")[1:]
    assert manager.num_free_blocks == 10 - 7


def test_hits_before_the_window_are_not_taken() -> None:
    from octavo.kv_cache.manager import FREED_BLOCK_ID

    manager = KVCacheManager(12, BS, enable_caching=True, sliding_window=5)
    prompt = list(range(40, 57))  # 17 tokens: 4 full blocks + 1
    a = make_request("a", prompt)
    run_prompt(manager, a)
    manager.free(a)  # all 5 blocks free, the 4 full ones still cached
    b = make_request("b", prompt[:16] + [99, 98])  # hits 4 blocks (16 tokens)
    hits, num_hit = manager.get_computed_blocks(b)
    assert num_hit == 16
    ids = manager.allocate_slots(b, b.num_tokens - num_hit, hits, num_hit)
    # Position 16 sees 12..16: hits 0..2 (positions 0..11) are not taken, hit 3 is.
    assert ids[:4] == [FREED_BLOCK_ID] * 3 + [hits[3].block_id] and len(ids) == 5
    assert [blk.ref_cnt for blk in hits] == [0, 0, 0, 1]
    # The skipped hits stay cached (and free): another request may still use them.
    assert all(manager.block_pool.get_cached_block(h) is not None for h in b.block_hashes[:3])
    assert manager.num_free_blocks == 12 - 2
    manager.free(b)
    assert manager.num_free_blocks == 12 and all(blk.ref_cnt == 0 for blk in manager.block_pool.blocks)


def test_a_freed_block_given_to_another_request_is_no_longer_a_hit() -> None:
    """A window-freed block keeps its prefix hash only until the pool reuses it; then the hash
    is gone and a later request with that prefix recomputes instead of reading foreign KV."""
    manager = KVCacheManager(4, BS, enable_caching=True, sliding_window=4)
    prompt = list(range(60, 69))  # 9 tokens: blocks 0..2
    a = make_request("a", prompt)
    run_prompt(manager, a)
    decode(manager, a, 1)  # position 9 sees 6..9: blocks 0 (0..3) freed, 1 (4..7) kept
    assert manager.num_window_freed_blocks == 1
    freed = manager.block_pool.get_cached_block(a.block_hashes[0])
    assert freed is not None and freed.ref_cnt == 0  # free, still a valid cached prefix
    # Another request takes the last free blocks: the freed one is reused and evicted.
    other = make_request("other", list(range(200, 206)))
    assert manager.allocate_slots(other, other.num_tokens) is not None
    assert freed.ref_cnt == 1 and freed.block_hash is None
    assert manager.block_pool.get_cached_block(a.block_hashes[0]) is None
    c = make_request("c", prompt)
    assert manager.get_computed_blocks(c) == ([], 0)  # the chain starts at block 0: no hit


# ---- sliding window with swapping and forking ----------------------------------------------------


def test_swap_of_a_request_with_window_freed_blocks_moves_only_live_blocks() -> None:
    from octavo.kv_cache.manager import FREED_BLOCK_ID

    # Two host blocks: room for the live blocks only, not for the freed placeholder.
    manager = KVCacheManager(10, BS, enable_caching=True, sliding_window=6, num_host_blocks=2)
    request = make_request("a", list(range(10, 20)))  # 10 tokens, blocks 0..2
    run_prompt(manager, request)
    decode(manager, request, 1)  # position 10 sees 5..10: block 0 freed
    assert manager.get_block_ids("a") == [FREED_BLOCK_ID, 1, 2]
    assert manager.num_blocks_held(request) == 2 and manager.can_swap_out([request])
    pairs = manager.swap_out(request)
    assert [device for device, _ in pairs] == [1, 2]
    assert manager.is_swapped(request) and manager.num_free_blocks == 10
    assert manager.num_free_host_blocks == 0
    # Back in: positions 0..11 need 3 blocks, one of them freed for good.
    assert manager.num_blocks_to_swap_in(request, 1) == 2
    pairs = manager.swap_in(request)
    assert [host for host, _ in pairs] == [0, 1]  # the host blocks swap_out filled
    ids = manager.get_block_ids("a")
    assert ids[0] == FREED_BLOCK_ID and ids[1:] == [device for _, device in pairs]
    assert manager.num_free_blocks == 8 and manager.num_free_host_blocks == 2
    # The window keeps moving after the swap: block 1 leaves it once the next token is at 13.
    for token in (2, 3, 4):
        decode(manager, request, token)
    assert manager.get_block_ids("a")[:2] == [FREED_BLOCK_ID, FREED_BLOCK_ID]
    assert manager.num_window_freed_blocks == 2 and manager.num_free_blocks == 8
    manager.free(request)
    assert manager.num_free_blocks == 10 and manager.num_requests_holding_blocks() == 0
    assert all(b.ref_cnt == 0 for b in manager.block_pool.blocks)


def test_free_of_a_swapped_request_with_window_freed_blocks() -> None:
    manager = KVCacheManager(10, BS, enable_caching=True, sliding_window=6, num_host_blocks=4)
    request = make_request("a", list(range(10, 20)))
    run_prompt(manager, request)
    decode(manager, request, 1)  # block 0 freed
    manager.swap_out(request)
    assert manager.num_free_host_blocks == 2
    manager.free(request)  # aborted while swapped out
    assert not manager.is_swapped(request) and manager.num_free_host_blocks == 4
    assert manager.num_free_blocks == 10 and all(b.ref_cnt == 0 for b in manager.block_pool.blocks)
    # A new request with the same id starts with nothing freed.
    again = make_request("a", list(range(30, 40)))
    assert manager.allocate_slots(again, again.num_tokens) is not None
    assert manager.num_blocks_held(again) == 3 and manager.num_window_freed_blocks == 1


def test_fork_of_a_request_with_window_freed_blocks_shares_only_live_blocks() -> None:
    from octavo.kv_cache.manager import FREED_BLOCK_ID

    manager = KVCacheManager(10, BS, enable_caching=True, sliding_window=6)
    prompt = list(range(10, 20))
    parent = make_request("a", prompt)
    run_prompt(manager, parent)
    decode(manager, parent, 1)  # block 0 freed; positions 0..10 computed
    child = make_request("b", prompt)
    child.append_output_token(1)
    child.num_computed_tokens = parent.num_computed_tokens
    manager.fork(parent, child)
    assert manager.get_block_ids("b") == [FREED_BLOCK_ID, 1, 2]
    blocks = manager.block_pool.blocks
    assert [blocks[i].ref_cnt for i in (0, 1, 2)] == [0, 2, 2]
    assert manager.num_blocks_held(child) == 2 and manager.num_free_blocks == 8
    # The child writes position 11 into the shared, partly filled block 2: it gets a copy.
    assert manager.num_blocks_to_allocate(child, 1) == 1
    decode(manager, child, 5)
    copies, replaced = manager.take_block_copies()
    (source, own), = copies
    assert source == 2 and replaced == {"b": [(2, own)]}
    assert manager.get_block_ids("b") == [FREED_BLOCK_ID, 1, own]
    assert blocks[2].ref_cnt == 1 and manager.num_free_blocks == 7
    # Both move on until block 1 leaves their windows: each drops its reference once.
    for token in (2, 3, 4):
        decode(manager, parent, token)
    assert blocks[1].ref_cnt == 1
    for token in (6, 7):
        decode(manager, child, token)
    assert blocks[1].ref_cnt == 0 and manager.num_window_freed_blocks == 3
    assert manager.get_block_ids("b")[:2] == [FREED_BLOCK_ID, FREED_BLOCK_ID]
    manager.free(parent)
    manager.free(child)
    assert manager.num_free_blocks == 10 and manager.num_requests_holding_blocks() == 0
    assert all(b.ref_cnt == 0 for b in blocks)


def test_blocks_to_allocate_counts_the_blocks_the_window_gives_back() -> None:
    """The scheduler's pre-check (``num_blocks_to_allocate``) nets out the blocks a step frees
    before it allocates, so a full pool does not preempt for a step that frees as much as it
    takes; a block another request still holds is not counted."""
    manager = KVCacheManager(3, BS, enable_caching=False, sliding_window=5)
    prompt = list(range(10, 22))  # 12 tokens: blocks 0..2, the pool is full
    request = make_request("a", prompt)
    run_prompt(manager, request)
    request.append_output_token(1)
    assert manager.num_free_blocks == 0
    # Position 12 needs block 3 and sees 8..12: block 0 and 1 (positions 0..7) are given back.
    assert manager.num_blocks_to_allocate(request, 1) == 0
    child = make_request("b", prompt)
    child.append_output_token(1)
    child.num_computed_tokens = request.num_computed_tokens
    manager.fork(request, child)  # blocks 0 and 1 now held twice: nothing returns to the pool
    assert manager.num_blocks_to_allocate(request, 1) == 1
    manager.free(child)
    ids = manager.allocate_slots(request, 1)
    assert ids is not None and len(ids) == 1 and manager.num_free_blocks == 1
    manager.free(request)
    assert manager.num_free_blocks == 3


def _manager_state(manager: KVCacheManager) -> tuple:
    pool = manager.block_pool
    return (
        {k: [b.block_id for b in v] for k, v in manager._req_blocks.items()},
        dict(manager._num_indexed), dict(manager._num_freed), pool.num_free_blocks,
        [(b.ref_cnt, b.block_hash) for b in pool.blocks], list(manager._copies),
        {k: list(v) for k, v in manager._replaced.items()},
    )


def test_fits_in_held_blocks_is_exactly_an_allocation_that_changes_nothing() -> None:
    """The scheduler skips allocate_slots when fits_in_held_blocks says so: for every decode
    position of caching on/off, a fork sharing a partly filled block and a sliding window,
    True must mean allocate_slots would return [] and change nothing (and
    num_blocks_to_allocate is 0), and False must mean it would not be such a no-op (or the
    check is conservative: a window, or no blocks yet)."""
    import copy
    import random

    rng = random.Random(0)
    for caching in (True, False):
        for window in (None, 6):
            manager = KVCacheManager(64, BS, enable_caching=caching, sliding_window=window)
            request = make_request("a", [rng.randrange(50) for _ in range(6)], max_tokens=40)
            assert not manager.fits_in_held_blocks(request, 1)  # holds no block yet
            run_prompt(manager, request)
            child = make_request("b", request.prompt_token_ids, max_tokens=40)
            if window is None:
                manager.fork(request, child)  # shares the partly filled last block
            for _ in range(30):
                for num_new in (1, 2, 3):
                    fits = manager.fits_in_held_blocks(request, num_new)
                    before = _manager_state(manager)
                    trial = copy.deepcopy(manager)
                    ids = trial.allocate_slots(request, num_new)
                    unchanged = ids == [] and _manager_state(trial) == before
                    if fits:
                        assert unchanged and window is None
                        assert manager.num_blocks_to_allocate(request, num_new) == 0
                    elif window is None:
                        assert not unchanged
                ids = manager.allocate_slots(request, 1)
                assert ids is not None
                request.num_computed_tokens += 1
                request.append_output_token(rng.randrange(50))


def test_fits_in_held_blocks_remembered_room_agrees_with_a_fresh_check() -> None:
    """fits_in_held_blocks remembers each request's room (``_decode_room``); across decode
    steps, tokens whose hashes lag (a token in flight), forks of a decoding request, swaps
    and frees, its answer must be the one a fresh check (nothing remembered) gives."""
    import random

    rng = random.Random(1)
    manager = KVCacheManager(256, BS, enable_caching=True, num_host_blocks=64)
    requests = [make_request(f"r{i}", [rng.randrange(50) for _ in range(3 + 2 * i)],
                             max_tokens=200) for i in range(3)]
    for request in requests:
        run_prompt(manager, request)
    num_checked = num_remembered = 0
    for step in range(60):
        for request in list(requests):
            for num_new in (1, 2):
                # A fresh check: nothing remembered (fits changes nothing else).
                room = manager._decode_room.pop(request.request_id, None)
                want = manager.fits_in_held_blocks(request, num_new)
                manager._decode_room.pop(request.request_id, None)
                if room is not None:
                    manager._decode_room[request.request_id] = room
                remembered = room is not None
                got = manager.fits_in_held_blocks(request, num_new)
                assert got == want, (step, request.request_id, num_new)
                num_checked += 1
                num_remembered += remembered
            if not manager.fits_in_held_blocks(request, 1):
                assert manager.allocate_slots(request, 1) is not None
            request.num_computed_tokens += 1
            if rng.random() < 0.7:  # else the token stays in flight a step (hashes lag)
                request.append_output_token(rng.randrange(50))
            while request.num_tokens < request.num_computed_tokens:
                request.append_output_token(rng.randrange(50))
        event = rng.random()
        if event < 0.08 and len(requests) < 6:  # a fork shares every block, the last too
            parent = rng.choice(requests)
            child = parent.fork(f"{parent.request_id}.{step}")
            manager.fork(parent, child)
            requests.append(child)
        elif event < 0.12:
            request = rng.choice(requests)
            if manager.can_swap_out([request]):
                manager.swap_out(request)
                manager.swap_in(request)
        elif event < 0.15 and len(requests) > 2:
            request = requests.pop(rng.randrange(len(requests)))
            manager.free(request)
    assert num_remembered > num_checked // 2  # the remembered room was used
