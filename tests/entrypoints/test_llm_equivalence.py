"""Engine settings that must not change greedy (or seeded) output, through ``octavo.LLM``.

Reference: prefix caching off, no chunking needed (default budget), a big KV pool, one batch.
Every variant below must produce the same token ids, and leave every KV block free.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from octavo.sampling_params import SamplingParams

from tests.helpers.engine import (
    assert_no_leaks,
    greedy,
    make_llm,
    prompts_of_lengths,
    random_prompts,
    token_ids,
)

NUM_TOKENS = 16
# Prompts of 5..45 tokens; the next three share a 24-token prefix, the last repeats one.
_BASE = prompts_of_lengths([5, 12, 17, 33, 40, 45], seed=1)
PROMPTS = _BASE + [_BASE[5][:24] + tail for tail in random_prompts(3, 3, 20, seed=2)] + [_BASE[2]]


@pytest.fixture(scope="module")
def folder(tiny_llama: Path) -> Path:
    return tiny_llama


@pytest.fixture(scope="module")
def reference(folder: Path) -> list[list[int]]:
    llm = make_llm(folder, enable_prefix_caching=False)
    ids = token_ids(llm.generate(PROMPTS, greedy(NUM_TOKENS), use_tqdm=False))
    assert_no_leaks(llm)
    assert all(len(t) == NUM_TOKENS for t in ids)
    assert len({tuple(t) for t in ids[:6]}) == 6, "the prompts should give different outputs"
    return ids


def run(llm, prompts=PROMPTS, params=None) -> list[list[int]]:
    ids = token_ids(llm.generate(prompts, params or greedy(NUM_TOKENS), use_tqdm=False))
    assert_no_leaks(llm)
    return ids


def test_prefix_caching_cold_warm_and_repeated(folder: Path, reference) -> None:
    llm = make_llm(folder, enable_prefix_caching=True)
    assert run(llm) == reference  # cold cache (shared prefixes hit within the batch)
    stats = llm.llm_engine.stats()
    assert stats.prefix_cache_hit_rate > 0
    outputs = llm.generate(PROMPTS, greedy(NUM_TOKENS), use_tqdm=False)  # warm cache
    assert token_ids(outputs) == reference
    # Every prompt is now cached except (at least) its last token.
    for prompt, output in zip(PROMPTS, outputs):
        assert output.metrics.num_cached_tokens == (len(prompt) - 1) // 16 * 16
    assert llm.llm_engine.stats().prefix_cache_hit_rate > stats.prefix_cache_hit_rate
    assert_no_leaks(llm)
    # The same prompt twice in one batch, and alone after that.
    assert run(llm, [PROMPTS[4], PROMPTS[4]]) == [reference[4], reference[4]]
    assert run(llm, [PROMPTS[4]]) == [reference[4]]


@pytest.mark.parametrize("chunked", [True, False])
def test_tiny_token_budget(folder: Path, reference, chunked: bool) -> None:
    llm = make_llm(folder, max_num_batched_tokens=8, enable_chunked_prefill=chunked,
                   max_model_len=128)
    assert run(llm) == reference


def test_chunked_prefill_really_chunks(folder: Path) -> None:
    llm = make_llm(folder, max_num_batched_tokens=8)
    engine = llm.llm_engine
    engine.add_request("long", PROMPTS[5], greedy(2))
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    assert steps >= len(PROMPTS[5]) // 8  # the 40+ token prompt took several steps
    assert_no_leaks(llm)


def test_preemption_gives_identical_output(folder: Path, reference) -> None:
    # 24 blocks of 4 tokens: each request needs up to 16 blocks, all of them ~100 together.
    llm = make_llm(folder, block_size=4, num_gpu_blocks_override=24)
    assert run(llm) == reference
    assert llm.llm_engine.stats().num_preemptions > 0


def test_preemption_without_prefix_caching(folder: Path, reference) -> None:
    llm = make_llm(folder, block_size=4, num_gpu_blocks_override=24,
                   enable_prefix_caching=False, max_num_batched_tokens=16)
    assert run(llm) == reference
    assert llm.llm_engine.stats().num_preemptions > 0


def test_prompt_logprobs_survive_preemption(folder: Path) -> None:
    params = greedy(NUM_TOKENS, prompt_logprobs=2, logprobs=1)
    big = make_llm(folder).generate(PROMPTS[:6], params, use_tqdm=False)
    small_llm = make_llm(folder, block_size=4, num_gpu_blocks_override=24)
    small = small_llm.generate(PROMPTS[:6], params, use_tqdm=False)
    assert small_llm.llm_engine.stats().num_preemptions > 0
    assert_no_leaks(small_llm)
    for expected, got in zip(big, small):
        assert len(got.prompt_logprobs) == len(got.prompt_token_ids)
        assert got.outputs[0].token_ids == expected.outputs[0].token_ids
        for want, have in zip(expected.prompt_logprobs[1:] + expected.outputs[0].logprobs,
                              got.prompt_logprobs[1:] + got.outputs[0].logprobs):
            assert want.keys() == have.keys()
            for token_id in want:
                assert have[token_id].logprob == pytest.approx(want[token_id].logprob, abs=1e-4)


def test_one_vs_32_concurrent_requests(folder: Path) -> None:
    prompts = random_prompts(32, 3, 30, seed=7)
    params = greedy(12)
    llm = make_llm(folder)
    batched = run(llm, prompts, params)
    single = [run(llm, [p], params)[0] for p in prompts]
    assert batched == single
    fresh = make_llm(folder, enable_prefix_caching=False)  # no cache hits from the runs above
    assert [run(fresh, [p], params)[0] for p in prompts[:4]] == batched[:4]


@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_block_sizes(folder: Path, reference, block_size: int) -> None:
    llm = make_llm(folder, block_size=block_size, num_gpu_blocks_override=2048 // block_size)
    assert run(llm) == reference


def test_n_greedy_completions_share_prompt_blocks(folder: Path, reference) -> None:
    llm = make_llm(folder)
    engine = llm.llm_engine
    prompt = PROMPTS[5]  # more than two full blocks of 16
    engine.add_request("req", prompt, greedy(NUM_TOKENS, n=3))
    engine.step()
    manager = engine.engine_core.scheduler.kv_cache_manager
    tables = [manager.get_block_ids(f"{i}_req") for i in range(3)]
    num_full = (len(prompt) - 1) // 16
    assert num_full >= 2
    # Completion 0 computed the prompt; the others were forked from it: every block shared.
    assert tables[0] == tables[1] == tables[2]
    engine.step()  # each completion writes its first token into the partial last block
    tables = [manager.get_block_ids(f"{i}_req") for i in range(3)]
    assert tables[0][:num_full] == tables[1][:num_full] == tables[2][:num_full]
    assert len(set(tables[0][num_full:]) & set(tables[1][num_full:])) == 0  # copied on write
    outputs = []
    while engine.has_unfinished_requests():
        outputs += [o for o in engine.step() if o.finished]
    (output,) = outputs
    assert [c.index for c in output.outputs] == [0, 1, 2]
    assert [list(c.token_ids) for c in output.outputs] == [reference[5]] * 3
    assert_no_leaks(llm)


def test_seeded_sampling_alone_batched_and_preempted(folder: Path) -> None:
    prompts = PROMPTS[:6]
    params = [SamplingParams(temperature=1.0, seed=100 + i, max_tokens=NUM_TOKENS,
                             ignore_eos=True) for i in range(len(prompts))]
    llm = make_llm(folder)
    alone = [run(llm, [p], [sp])[0] for p, sp in zip(prompts, params)]
    batched = run(llm, prompts, params)
    # Different unseeded neighbours in the batch must not matter either.
    noisy = prompts + random_prompts(4, 5, 20, seed=9)
    noisy_params = params + [SamplingParams(temperature=1.0, max_tokens=NUM_TOKENS)] * 4
    mixed = run(llm, noisy, noisy_params)[: len(prompts)]
    small = make_llm(folder, block_size=4, num_gpu_blocks_override=24)
    preempted = run(small, prompts, params)
    assert small.llm_engine.stats().num_preemptions > 0
    assert alone == batched == mixed == preempted
    greedy_ids = run(llm, prompts, greedy(NUM_TOKENS))
    assert alone != greedy_ids  # it really sampled


def test_max_num_seqs_one(folder: Path, reference) -> None:
    llm = make_llm(folder, max_num_seqs=1)
    assert run(llm) == reference


def test_mixed_workload_under_pressure(folder: Path) -> None:
    """Stop strings, stop ids, n > 1, seeds, logprobs and lengths together: a small pool with
    preemption and a tiny chunk budget gives exactly what a big pool gives."""
    prompts = PROMPTS[:8]
    roomy = make_llm(folder)
    plain = roomy.generate(prompts, greedy(NUM_TOKENS), use_tqdm=False)
    params = []
    for i, out in enumerate(plain):
        text, ids = out.outputs[0].text, out.outputs[0].token_ids
        kinds = [
            greedy(NUM_TOKENS, stop=[text[6:8]] if len(text) > 8 else None),
            greedy(NUM_TOKENS, stop_token_ids=[ids[5]]),
            greedy(NUM_TOKENS, n=2, logprobs=2),
            SamplingParams(temperature=0.8, top_p=0.9, seed=i, max_tokens=NUM_TOKENS, n=2,
                           ignore_eos=True),
            greedy(3 + i, prompt_logprobs=1),
        ]
        params.append(kinds[i % len(kinds)])

    def summary(llm):
        outputs = llm.generate(prompts, params, use_tqdm=False)
        assert_no_leaks(llm)
        return [
            (len(o.prompt_logprobs or []),
             [(tuple(c.token_ids), c.text, c.finish_reason, c.stop_reason) for c in o.outputs])
            for o in outputs
        ]

    expected = summary(roomy)
    assert any(s[1][0][2] == "stop" for s in expected), "no stop rule fired"
    tight = make_llm(folder, block_size=4, num_gpu_blocks_override=24, max_num_batched_tokens=8)
    assert summary(tight) == expected
    assert tight.llm_engine.stats().num_preemptions > 0
