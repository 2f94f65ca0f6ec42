"""Engine-level helpers of the tests: the no-leak invariant, greedy params, prompts.

Shared by the conformance suite and Octavo's own tests (``tests/helpers/engine.py``).
"""

from __future__ import annotations

import random
from typing import Any

from octavo.sampling_params import SamplingParams


def assert_no_leaks(llm: Any) -> None:
    """Every KV block is back in the pool and nothing still tracks a request (nor its
    grammar).

    ``llm`` is an ``octavo.LLM``; call this when no request should be left.
    """
    engine = llm.llm_engine
    scheduler = engine.engine_core.scheduler
    assert engine.num_free_blocks == engine.num_blocks, (
        f"{engine.num_blocks - engine.num_free_blocks} of {engine.num_blocks} KV blocks leaked"
    )
    assert not scheduler.requests, f"scheduler still holds {sorted(scheduler.requests)}"
    assert not scheduler.waiting and not scheduler.running, "scheduler queues are not empty"
    assert scheduler.kv_cache_manager.num_requests_holding_blocks() == 0
    assert not engine.has_unfinished_requests(), "the output processor still tracks requests"
    for block in scheduler.kv_cache_manager.block_pool.blocks:
        assert block.ref_cnt == 0, f"block {block.block_id} has ref_cnt {block.ref_cnt}"
    structured = engine.engine_core.structured_outputs
    assert structured.num_active == 0, f"{structured.num_active} grammars are still held"


def greedy(max_tokens: int = 16, **kwargs: Any) -> SamplingParams:
    """Greedy decoding of exactly ``max_tokens`` tokens (EOS ignored) unless told otherwise."""
    kwargs.setdefault("ignore_eos", True)
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kwargs)


def token_ids(outputs: list[Any]) -> list[list[int]]:
    """The first completion's token ids of every ``RequestOutput``."""
    return [list(out.outputs[0].token_ids) for out in outputs]


def random_prompts(count: int, min_len: int, max_len: int, seed: int = 0,
                   vocab_size: int = 384) -> list[list[int]]:
    """``count`` token-id prompts of random lengths in ``[min_len, max_len]`` (no special ids)."""
    rng = random.Random(seed)
    lengths = [rng.randint(min_len, max_len) for _ in range(count)]
    return prompts_of_lengths(lengths, seed=seed + 1, vocab_size=vocab_size)


def prompts_of_lengths(lengths: list[int], seed: int = 0, vocab_size: int = 384) -> list[list[int]]:
    """Random token-id prompts of the given lengths (ids 8.., so no special tokens)."""
    rng = random.Random(seed)
    return [[rng.randrange(8, vocab_size) for _ in range(n)] for n in lengths]
