"""Completions of one request share its prompt's KV blocks (n > 1, best_of) whether or not
prefix caching is on, and sample exactly as separate requests with their seeds would; beam
search in the engine against transformers' ``num_beams`` (same beams, same order, same scores);
priority scheduling."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from octavo.engine.processor import child_seed
from octavo.errors import InvalidRequestError
from octavo.sampling_params import BeamSearchParams, SamplingParams

from tests.helpers.engine import assert_no_leaks, greedy, make_llm, random_prompts

PROMPT = random_prompts(1, 16, 16, seed=5)[0]  # 16 tokens: exactly 4 blocks of 4


@pytest.fixture(scope="module")
def llm(tiny_llama: Path):
    llm = make_llm(tiny_llama, enable_prefix_caching=False, block_size=4)
    yield llm
    llm.llm_engine.shutdown()


def test_n4_without_prefix_caching_uses_one_prompts_blocks(llm) -> None:
    engine = llm.llm_engine
    manager = engine.engine_core.scheduler.kv_cache_manager
    params = SamplingParams(n=4, temperature=1.0, seed=1, max_tokens=6, ignore_eos=True)
    engine.add_request("r", {"prompt_token_ids": PROMPT}, params)
    used = []
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final = out
        used.append(manager.num_blocks - manager.num_free_blocks)
    # The prompt's 4 blocks, computed once; then each completion's own block for the tokens it
    # writes at positions 16-19 (measured after each step; the block the last step needed is
    # freed when it finishes). Without sharing: 4 x 5 blocks.
    assert used[0] == 4, used
    assert max(used) == 4 + 4 * 1, used
    assert used[-1] == 0
    assert_no_leaks(llm)
    # Each completion samples as a separate request with its own seed would.
    for i, completion in enumerate(final.outputs):
        alone = SamplingParams(temperature=1.0, seed=child_seed(1, i, 4), max_tokens=6,
                               ignore_eos=True)
        want = llm.generate({"prompt_token_ids": PROMPT}, alone, use_tqdm=False)[0]
        assert list(completion.token_ids) == list(want.outputs[0].token_ids)


def test_partial_last_block_is_copied_on_write(llm) -> None:
    prompt = PROMPT[:14]  # the last prompt block is half full: every completion writes into it
    params = SamplingParams(n=3, temperature=1.0, seed=2, max_tokens=8, ignore_eos=True)
    out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
    for i, completion in enumerate(out.outputs):
        alone = SamplingParams(temperature=1.0, seed=child_seed(2, i, 3), max_tokens=8,
                               ignore_eos=True)
        want = llm.generate({"prompt_token_ids": prompt}, alone, use_tqdm=False)[0]
        assert list(completion.token_ids) == list(want.outputs[0].token_ids)
    assert_no_leaks(llm)


def test_best_of_returns_the_n_most_likely(llm) -> None:
    params = SamplingParams(n=2, best_of=5, temperature=1.0, seed=4, max_tokens=6,
                            ignore_eos=True)
    out = llm.generate({"prompt_token_ids": PROMPT}, params, use_tqdm=False)[0]
    assert len(out.outputs) == 2
    every = [llm.generate({"prompt_token_ids": PROMPT},
                          SamplingParams(temperature=1.0, seed=child_seed(4, i, 5), max_tokens=6,
                                         ignore_eos=True, logprobs=0), use_tqdm=False)[0]
             for i in range(5)]
    ranked = sorted((c.outputs[0] for c in every), key=lambda c: -c.cumulative_logprob)
    assert [list(c.token_ids) for c in out.outputs] == [list(c.token_ids) for c in ranked[:2]]
    assert_no_leaks(llm)


@pytest.mark.parametrize(("beam_width", "length_penalty"), [(2, 1.0), (4, 1.0), (3, 0.5)])
def test_beam_search_matches_transformers(llm, tiny_llama: Path, beam_width: int,
                                          length_penalty: float) -> None:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    prompts = random_prompts(2, 5, 12, seed=beam_width)
    params = BeamSearchParams(beam_width=beam_width, max_tokens=8, length_penalty=length_penalty)
    results = llm.beam_search([{"prompt_token_ids": p} for p in prompts], params)
    for prompt, result in zip(prompts, results):
        ref = hf.generate(torch.tensor([prompt]), num_beams=beam_width,
                          num_return_sequences=beam_width, max_new_tokens=8, do_sample=False,
                          length_penalty=length_penalty, early_stopping=False,
                          output_scores=True, return_dict_in_generate=True, pad_token_id=0)
        want = ref.sequences[:, len(prompt):].tolist()
        got = [s.tokens[len(prompt):] for s in result.sequences]
        assert got == want
        for seq, score in zip(result.sequences, ref.sequences_scores.tolist()):
            generated = len(seq.tokens) - len(prompt)
            assert abs(seq.cum_logprob / generated ** length_penalty - score) < 1e-3
    assert_no_leaks(llm)


def test_beam_search_is_refused_when_it_cannot_run(llm) -> None:
    with pytest.raises(InvalidRequestError, match="max_num_seqs"):
        llm.beam_search("hi", BeamSearchParams(beam_width=10**4, max_tokens=2))
    with pytest.raises(InvalidRequestError, match="temperature must be 0"):
        BeamSearchParams(beam_width=2, max_tokens=2, temperature=0.5)


def test_priority_orders_service_and_preemption(tiny_llama: Path) -> None:
    llm = make_llm(tiny_llama, scheduling_policy="priority", max_num_seqs=2)
    try:
        prompts = [{"prompt_token_ids": p} for p in random_prompts(4, 5, 10, seed=9)]
        outs = llm.generate(prompts, greedy(4), use_tqdm=False, priority=[3, 2, 1, 0])
        started = [o.metrics.first_scheduled_time for o in outs]
        # Two run at once: priorities 0 and 1 first, then 2 and 3.
        assert max(started[2:]) < min(started[:2]), started
        assert_no_leaks(llm)
    finally:
        llm.llm_engine.shutdown()
    with pytest.raises(InvalidRequestError, match="--scheduling-policy priority"):
        make_llm(tiny_llama).generate("hi", greedy(2), use_tqdm=False, priority=[1])


def test_a_full_pool_preempts_the_lowest_priority(tiny_llama: Path) -> None:
    # 12 blocks of 4 tokens: two 20-token requests of 24 tokens fill it; a third must preempt.
    llm = make_llm(tiny_llama, scheduling_policy="priority", block_size=4,
                   num_gpu_blocks_override=12)
    engine = llm.llm_engine
    scheduler = engine.engine_core.scheduler
    try:
        prompts = random_prompts(3, 20, 20, seed=4)
        engine.add_request("low", {"prompt_token_ids": prompts[0]}, greedy(24), priority=5)
        engine.add_request("mid", {"prompt_token_ids": prompts[1]}, greedy(24), priority=1)
        for _ in range(3):
            engine.step()
        engine.add_request("high", {"prompt_token_ids": prompts[2]}, greedy(24), priority=0)
        finished: list[str] = []
        preempted: set[str] = set()
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    finished.append(out.request_id)
            preempted |= {r.request_id for r in scheduler.requests.values()
                          if r.num_preemptions}
        assert "low" in preempted and "high" not in preempted
        assert finished.index("high") < finished.index("low")
        assert_no_leaks(llm)
    finally:
        engine.shutdown()
