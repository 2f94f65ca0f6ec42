"""Blocks freed as outside the sliding window, through the engine together with preemption by
swapping and with forked completions (n > 1): the ``mistral-swa`` tiny model (every layer
windowed to 8 positions) gives the same greedy tokens and logprobs on a tiny pool that swaps as
on a pool that never preempts, and forked completions sample as separate requests would."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from octavo.engine.processor import child_seed
from octavo.kv_cache.manager import FREED_BLOCK_ID
from octavo.sampling_params import SamplingParams

from tests.helpers.engine import assert_no_leaks, greedy, make_llm, random_prompts

PROMPTS = random_prompts(8, 10, 40, seed=11)
# 16 blocks of 4 tokens (what the longest request may need: the processor's admission check
# does not count window freeing) for 8 requests of up to 64 tokens: the pool preempts, and the
# swap threshold (4 computed tokens) is met.
TINY_POOL = {"block_size": 4, "num_gpu_blocks_override": 16, "max_num_batched_tokens": 16}


@pytest.fixture(scope="module")
def mistral_swa(tiny_model_factory: Callable[[str], Path]) -> Path:
    return tiny_model_factory("mistral-swa")


def run(llm, prompts=PROMPTS, max_tokens=24) -> list:
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           greedy(max_tokens, logprobs=2), use_tqdm=False)
    return [(list(o.outputs[0].token_ids),
             [{t: lp.logprob for t, lp in pos.items()} for pos in o.outputs[0].logprobs])
            for o in outputs]


def assert_same(got, want) -> None:
    for (tokens, logprobs), (want_tokens, want_logprobs) in zip(got, want, strict=True):
        assert tokens == want_tokens
        for pos, want_pos in zip(logprobs, want_logprobs, strict=True):
            assert pos.keys() == want_pos.keys()
            for token_id, value in pos.items():
                assert abs(value - want_pos[token_id]) < 1e-4


def test_swap_preemption_with_window_freed_blocks_keeps_greedy_outputs(mistral_swa: Path) -> None:
    reference_llm = make_llm(mistral_swa)
    try:
        reference = run(reference_llm)
        assert reference_llm.llm_engine.stats().num_preemptions == 0
    finally:
        reference_llm.llm_engine.shutdown()

    llm = make_llm(mistral_swa, preemption_mode="swap", swap_space=0.01, **TINY_POOL)
    try:
        scheduler = llm.llm_engine.engine_core.scheduler
        manager = scheduler.kv_cache_manager
        assert manager.sliding_window == 8
        # Record, for every swap-out, how many of the request's blocks were window-freed.
        freed_at_swap: list[int] = []
        swap_out = manager.swap_out

        def spy(request):
            table = manager.get_block_ids(request.request_id)
            freed_at_swap.append(len(table) - manager.num_blocks_held(request))
            return swap_out(request)

        manager.swap_out = spy
        assert_same(run(llm), reference)
        stats = llm.llm_engine.stats()
        assert stats.num_preemptions_swap > 0 and manager.num_window_freed_blocks > 0
        assert any(n > 0 for n in freed_at_swap), freed_at_swap
        assert not scheduler.swapped
        assert manager.num_free_host_blocks == manager.num_host_blocks
        assert_no_leaks(llm)
    finally:
        llm.llm_engine.shutdown()


def test_forks_of_a_prompt_with_window_freed_blocks_sample_as_separate_requests(
        mistral_swa: Path) -> None:
    # A 30-token prompt in chunks of 12: its last chunk starts at position 24, so blocks 0..3
    # (positions 0..15) are freed before its completions fork from it.
    prompt = random_prompts(1, 30, 30, seed=12)[0]
    llm = make_llm(mistral_swa, block_size=4, max_num_batched_tokens=12,
                   enable_prefix_caching=False)
    try:
        manager = llm.llm_engine.engine_core.scheduler.kv_cache_manager
        forked_tables: list[list[int]] = []
        fork = manager.fork

        def spy(parent, child):
            fork(parent, child)
            forked_tables.append(manager.get_block_ids(child.request_id))

        manager.fork = spy
        params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=12, ignore_eos=True)
        out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
        assert len(forked_tables) == 2
        for table in forked_tables:
            assert table[:4] == [FREED_BLOCK_ID] * 4 and FREED_BLOCK_ID not in table[4:]
        assert_no_leaks(llm)
        for i, completion in enumerate(out.outputs):
            alone = SamplingParams(temperature=1.0, seed=child_seed(7, i, 3), max_tokens=12,
                                   ignore_eos=True)
            want = llm.generate({"prompt_token_ids": prompt}, alone, use_tqdm=False)[0]
            assert list(completion.token_ids) == list(want.outputs[0].token_ids)
        assert_no_leaks(llm)
    finally:
        llm.llm_engine.shutdown()


def test_beam_search_with_window_freed_blocks_matches_transformers(mistral_swa: Path) -> None:
    """Beams fork from beams whose leading blocks left the window (placeholders shared, only live
    blocks referenced): same beams and scores as transformers' ``num_beams``."""
    import torch
    from octavo.sampling_params import BeamSearchParams
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(mistral_swa, dtype=torch.float32)
    llm = make_llm(mistral_swa, block_size=4, enable_prefix_caching=False)
    try:
        manager = llm.llm_engine.engine_core.scheduler.kv_cache_manager
        freed_at_fork: list[int] = []
        fork = manager.fork

        def spy(parent, child):
            fork(parent, child)
            freed_at_fork.append(len(manager.get_block_ids(child.request_id))
                                 - manager.num_blocks_held(child))

        manager.fork = spy
        prompts = random_prompts(2, 10, 16, seed=13)
        params = BeamSearchParams(beam_width=3, max_tokens=12)
        results = llm.beam_search([{"prompt_token_ids": p} for p in prompts], params)
        assert any(n > 0 for n in freed_at_fork), freed_at_fork
        for prompt, result in zip(prompts, results):
            ref = hf.generate(torch.tensor([prompt]), num_beams=3, num_return_sequences=3,
                              max_new_tokens=12, do_sample=False, early_stopping=False,
                              output_scores=True, return_dict_in_generate=True, pad_token_id=0)
            assert [s.tokens[len(prompt):] for s in result.sequences] == \
                ref.sequences[:, len(prompt):].tolist()
            for seq, score in zip(result.sequences, ref.sequences_scores.tolist()):
                assert abs(seq.cum_logprob / (len(seq.tokens) - len(prompt)) - score) < 1e-3
        assert_no_leaks(llm)
    finally:
        llm.llm_engine.shutdown()
