"""Engine settings that must not change greedy output on the backend.

Reference: prefix caching off, the default token budget, a roomy KV pool, one batch. Prefix
caching (cold and warm), chunked prefill under a tiny token budget, preemption forced by a
KV pool of a few blocks, and one request at a time must give the same token ids and leave
every block free. In float32 "the same" is exact; a 16-bit-only backend cannot promise that
(batch shape changes rounding), so there each run's choices are checked against Hugging Face
within the dtype's tolerance instead.
"""

from __future__ import annotations

import pytest

from octavo.testing.compare import GreedyEquivalence
from octavo.testing.engine_checks import (
    assert_no_leaks,
    greedy,
    prompts_of_lengths,
    random_prompts,
    token_ids,
)
from octavo.testing.engines import open_llm

NUM_TOKENS = 16
# Prompts of 5..45 tokens; the next three share a 24-token prefix, the last repeats one.
_BASE = prompts_of_lengths([5, 12, 17, 33, 40, 45], seed=1)
PROMPTS = _BASE + [_BASE[5][:24] + tail for tail in random_prompts(3, 3, 20, seed=2)] + [_BASE[2]]
LONGEST = max(len(p) for p in PROMPTS) + NUM_TOKENS


@pytest.fixture(scope="module")
def reference(octavo_plan, octavo_tiny_llama) -> list[list[int]]:
    with open_llm(octavo_plan, octavo_tiny_llama, enable_prefix_caching=False) as llm:
        ids = run(llm, PROMPTS)
    assert len({tuple(t) for t in ids[:6]}) == 6, "the prompts should give different outputs"
    return ids


@pytest.fixture(scope="module")
def check(octavo_plan, octavo_tiny_llama, reference):
    """``check(ids, what)``: ``ids``, generated for the first ``len(ids)`` prompts of PROMPTS,
    are equivalent to the reference run."""
    equivalence = GreedyEquivalence(octavo_tiny_llama, octavo_plan.model_dtype)

    def check_ids(ids: list[list[int]], what: str) -> None:
        equivalence.check(PROMPTS[: len(ids)], ids, reference[: len(ids)], what)

    return check_ids


def run(llm, prompts) -> list[list[int]]:
    ids = token_ids(llm.generate(prompts, greedy(NUM_TOKENS), use_tqdm=False))
    assert_no_leaks(llm)
    assert all(len(t) == NUM_TOKENS for t in ids)
    return ids


def test_prefix_caching_cold_and_warm(octavo_plan, octavo_tiny_llama, check):
    with open_llm(octavo_plan, octavo_tiny_llama, enable_prefix_caching=True) as llm:
        check(run(llm, PROMPTS), "prefix caching, cold cache")
        outputs = llm.generate(PROMPTS, greedy(NUM_TOKENS), use_tqdm=False)
        assert_no_leaks(llm)
        check(token_ids(outputs), "prefix caching, warm cache")
        assert llm.llm_engine.stats().prefix_cache_hit_rate > 0
        assert any(o.metrics.num_cached_tokens > 0 for o in outputs), "no prefix was reused"


def test_chunked_prefill_with_a_tiny_token_budget(octavo_plan, octavo_tiny_llama, check):
    with open_llm(octavo_plan, octavo_tiny_llama, max_num_batched_tokens=8) as llm:
        check(run(llm, PROMPTS), "token budget 8")


@pytest.mark.parametrize("prefix_caching", [True, False], ids=["prefix-cache", "no-prefix-cache"])
def test_preemption_with_a_kv_pool_of_a_few_blocks(
    octavo_plan, octavo_tiny_llama, check, prefix_caching
):
    block_size = octavo_plan.small_block_size
    # Room for the longest request and half of another: the batch must preempt.
    num_blocks = -(-LONGEST // block_size) * 3 // 2
    with open_llm(octavo_plan, octavo_tiny_llama, block_size=block_size,
                  num_gpu_blocks_override=num_blocks,
                  enable_prefix_caching=prefix_caching, max_num_batched_tokens=16) as llm:
        check(run(llm, PROMPTS), f"{num_blocks} blocks of {block_size} tokens")
        assert llm.llm_engine.stats().num_preemptions > 0, "the tight pool did not preempt"


def test_one_request_at_a_time(octavo_plan, octavo_tiny_llama, check):
    with open_llm(octavo_plan, octavo_tiny_llama, enable_prefix_caching=False) as llm:
        check([run(llm, [prompt])[0] for prompt in PROMPTS[:4]], "one request at a time")
