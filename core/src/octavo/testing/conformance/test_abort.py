"""Aborting requests on the backend leaks no KV block and corrupts nothing.

Requests are aborted while waiting, in the middle of a chunked prefill, and while decoding;
the others finish with the output they have alone, every block returns to the pool, and the
same prompts run again afterwards (over prefix-cache blocks the aborted requests left) give
the same output.
"""

from __future__ import annotations

import pytest

from octavo.testing.compare import GreedyEquivalence
from octavo.testing.engine_checks import assert_no_leaks, greedy, prompts_of_lengths, token_ids
from octavo.testing.engines import open_llm

NUM_TOKENS = 8
PROMPTS = prompts_of_lengths([40, 33, 20, 12, 45, 9], seed=3)
# With a budget of 16 tokens per step the first prompts take several steps to prefill.
TOKEN_BUDGET = 16
MAX_STEPS = 200


@pytest.fixture(scope="module")
def expected(octavo_plan, octavo_tiny_llama) -> list[list[int]]:
    with open_llm(octavo_plan, octavo_tiny_llama, enable_prefix_caching=False) as llm:
        ids = token_ids(llm.generate(PROMPTS, greedy(NUM_TOKENS), use_tqdm=False))
        assert_no_leaks(llm)
    return ids


def step_until(engine, done, finished: dict) -> None:
    """Step ``engine`` until ``done(outputs)`` holds for one step's outputs."""
    for _ in range(MAX_STEPS):
        outputs = engine.step()
        finished.update({o.request_id: list(o.outputs[0].token_ids) for o in outputs if o.finished})
        if done(outputs):
            return
    raise AssertionError(f"condition not reached in {MAX_STEPS} steps")


def test_abort_waiting_prefilling_and_decoding_requests(octavo_plan, octavo_tiny_llama, expected):
    with open_llm(octavo_plan, octavo_tiny_llama, max_num_batched_tokens=TOKEN_BUDGET) as llm:
        engine = llm.llm_engine
        for i, prompt in enumerate(PROMPTS):
            engine.add_request(f"r{i}", prompt, greedy(NUM_TOKENS))
        finished: dict[str, list[int]] = {}
        engine.step()  # r0 is part-way through its 40-token prompt; the others wait
        assert engine.num_free_blocks < engine.num_blocks
        engine.abort_request(["r0", "r3"])  # mid-prefill and still waiting
        step_until(engine, lambda outs: any(
            o.request_id == "r1" and len(o.outputs[0].token_ids) >= 2 for o in outs), finished)
        engine.abort_request(["r1"])  # decoding
        step_until(engine, lambda outs: not engine.has_unfinished_requests(), finished)
        assert sorted(finished) == ["r2", "r4", "r5"], sorted(finished)
        assert_no_leaks(llm)
        equivalence = GreedyEquivalence(octavo_tiny_llama, octavo_plan.model_dtype)
        kept = [2, 4, 5]
        equivalence.check([PROMPTS[i] for i in kept], [finished[f"r{i}"] for i in kept],
                          [expected[i] for i in kept], "requests next to aborted ones")
        again = token_ids(llm.generate(PROMPTS, greedy(NUM_TOKENS), use_tqdm=False))
        assert_no_leaks(llm)
        equivalence.check(PROMPTS, again, expected, "the same prompts after the aborts")


def test_abort_everything_mid_flight(octavo_plan, octavo_tiny_llama):
    with open_llm(octavo_plan, octavo_tiny_llama, max_num_batched_tokens=TOKEN_BUDGET) as llm:
        engine = llm.llm_engine
        for i, prompt in enumerate(PROMPTS):
            engine.add_request(f"r{i}", prompt, greedy(NUM_TOKENS))
        for _ in range(5):
            engine.step()
        assert engine.num_free_blocks < engine.num_blocks
        engine.abort_request([f"r{i}" for i in range(len(PROMPTS))])
        assert_no_leaks(llm)
