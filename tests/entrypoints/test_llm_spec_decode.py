"""Speculative decoding (ngram) through ``octavo.LLM``: greedy outputs (and logprobs) equal
those without speculation, with drafts really accepted, in every engine situation that touches
the drafts' tokens and KV slots: continuous batching with prefills in the same step, prefix
caching, stops and max_tokens inside an accepted run, n > 1, penalties, preemption."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from octavo.sampling_params import SamplingParams

from tests.helpers.engine import (
    assert_no_leaks,
    greedy,
    make_llm,
    record_mixed_spec_steps,
    spec_prompts,
    token_ids,
)

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3}
NUM_TOKENS = 40
PROMPTS = spec_prompts()


@pytest.fixture(scope="module")
def folder(tiny_llama: Path) -> Path:
    return tiny_llama


@pytest.fixture(scope="module")
def plain(folder: Path):
    return make_llm(folder)


@pytest.fixture(scope="module")
def reference(plain) -> list[list[int]]:
    return token_ids(plain.generate(PROMPTS, greedy(NUM_TOKENS), use_tqdm=False))


def _accepted(llm) -> int:
    return llm.llm_engine.stats().spec_decode_num_accepted_tokens


def run(llm, prompts=PROMPTS, params=None) -> list[list[int]]:
    ids = token_ids(llm.generate(prompts, params or greedy(NUM_TOKENS), use_tqdm=False))
    assert_no_leaks(llm)
    return ids


def test_greedy_equal_with_drafts_accepted(folder: Path, reference) -> None:
    llm = make_llm(folder, speculative_config=NGRAM)
    assert run(llm) == reference
    stats = llm.llm_engine.stats()
    assert stats.spec_decode_num_drafts > 0
    assert stats.spec_decode_num_accepted_tokens > 0
    assert 0 < stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens
    per_pos = stats.spec_decode_num_accepted_tokens_per_pos
    assert sum(per_pos) == stats.spec_decode_num_accepted_tokens
    assert all(a >= b for a, b in zip(per_pos, per_pos[1:]))  # a draft is accepted in order
    # Fewer steps than tokens: some steps emitted several tokens.
    assert stats.spec_decode_num_drafts + stats.spec_decode_num_accepted_tokens > 0


def test_json_string_config_and_other_lookup_sizes(folder: Path, reference) -> None:
    llm = make_llm(folder, speculative_config='{"method": "ngram", "num_speculative_tokens": 2}')
    config = llm.llm_engine.config.speculative_config
    assert (config.prompt_lookup_min, config.prompt_lookup_max) == (5, 5)  # vLLM's defaults
    assert run(llm) == reference
    llm = make_llm(folder, speculative_config={**NGRAM, "num_speculative_tokens": 7,
                                               "prompt_lookup_max": 5})
    assert run(llm) == reference
    assert _accepted(llm) > 0


def test_mixed_batch_with_prefill_in_the_same_step(folder: Path, reference) -> None:
    """A small token budget: prompt chunks share steps with requests verifying drafts, some
    requests cut short of their drafts by the budget."""
    llm = make_llm(folder, speculative_config=NGRAM, max_num_batched_tokens=12, max_num_seqs=4)
    mixed_steps = record_mixed_spec_steps(llm)
    assert run(llm) == reference
    assert mixed_steps, "no step mixed a prefill with draft verification"
    assert _accepted(llm) > 0


def test_prefix_caching_cold_and_warm(folder: Path, reference) -> None:
    llm = make_llm(folder, speculative_config=NGRAM, enable_prefix_caching=True)
    assert run(llm) == reference
    assert run(llm) == reference  # warm: prompts served from cached blocks
    # Outputs as prompts: blocks written while drafts were verified are cached, then hit.
    continued = [p + r[:24] for p, r in zip(PROMPTS, reference)]
    expected = run(make_llm(folder, enable_prefix_caching=False), continued, greedy(8))
    assert run(llm, continued, greedy(8)) == expected
    assert llm.llm_engine.stats().prefix_cache_hits > 0
    assert _accepted(llm) > 0


def test_max_tokens_and_stop_tokens_cut_inside_accepted_drafts(folder: Path, plain,
                                                               reference) -> None:
    llm = make_llm(folder, speculative_config=NGRAM)
    for max_tokens in (1, 2, 3, 5, 8, 13):
        assert run(llm, params=greedy(max_tokens)) == [r[:max_tokens] for r in reference]
    # A stop token id met in the middle of a multi-token step: the output is cut right after
    # it, as without speculation. Candidates: tokens a step emitted before its last one.
    core = llm.llm_engine.engine_core
    update = core.scheduler.update_from_output
    emitted: list[list[int]] = []

    def recording_update(scheduler_output, runner_output):
        emitted.extend(runner_output.sampled_token_ids)
        return update(scheduler_output, runner_output)

    core.scheduler.update_from_output = recording_update
    cut_inside_a_step = 0
    # Prompts holding the model's own continuation: drafts copied from the prompt, which
    # the output has not met yet, get accepted.
    for prompt, ref in zip(PROMPTS, reference):
        prompt = prompt + ref + prompt + ref[:10]
        emitted.clear()
        ref = run(llm, [prompt])[0]
        candidates = {t for tokens in emitted for t in tokens[:-1]}
        for stop in sorted(candidates):
            params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS,
                                    stop_token_ids=[stop])
            expected = plain.generate([prompt], params, use_tqdm=False)[0].outputs[0]
            emitted.clear()
            out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
            assert list(out.token_ids) == list(expected.token_ids)
            assert (out.finish_reason, out.stop_reason) == (expected.finish_reason, stop)
            # The step that emitted the stop token had emitted more after it.
            last = emitted[-1]
            cut_inside_a_step += stop in last[:-1]
        if cut_inside_a_step:
            break
    assert cut_inside_a_step > 0
    core.scheduler.update_from_output = update
    assert_no_leaks(llm)
    # Stop strings (cut by the front end): the same text as without speculation.
    text = plain.generate([prompt], greedy(NUM_TOKENS), use_tqdm=False)[0].outputs[0].text
    stop_text = text[len(text) // 2 : len(text) // 2 + 2]
    params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, stop=[stop_text])
    with_spec = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    without = plain.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    assert with_spec.text == without.text and with_spec.finish_reason == "stop"
    assert_no_leaks(llm)
    assert _accepted(llm) > 0


def test_logprobs_per_emitted_token(folder: Path, plain) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=24, logprobs=3, prompt_logprobs=2)
    expected = plain.generate(PROMPTS[:4], params, use_tqdm=False)
    llm = make_llm(folder, speculative_config=NGRAM)
    got = llm.generate(PROMPTS[:4], params, use_tqdm=False)
    assert_no_leaks(llm)
    assert _accepted(llm) > 0
    for a, b in zip(got, expected):
        out_a, out_b = a.outputs[0], b.outputs[0]
        assert list(out_a.token_ids) == list(out_b.token_ids)
        assert len(out_a.logprobs) == len(out_a.token_ids)
        for pos_a, pos_b in zip(out_a.logprobs, out_b.logprobs):
            assert set(pos_a) == set(pos_b)
            for token, lp in pos_a.items():
                assert math.isclose(lp.logprob, pos_b[token].logprob, abs_tol=1e-4)
                assert lp.rank == pos_b[token].rank
        assert len(a.prompt_logprobs) == len(b.prompt_logprobs)


def test_n_greater_than_one_and_penalties(folder: Path, plain) -> None:
    llm = make_llm(folder, speculative_config=NGRAM)
    params = SamplingParams(n=3, temperature=0.0, max_tokens=30)
    got = llm.generate(PROMPTS[:3], params, use_tqdm=False)
    expected = plain.generate(PROMPTS[:3], params, use_tqdm=False)
    for a, b in zip(got, expected):
        assert [list(o.token_ids) for o in a.outputs] == [list(o.token_ids) for o in b.outputs]
    # Penalties see the drafts before each verified position.
    params = SamplingParams(temperature=0.0, max_tokens=30, repetition_penalty=1.2,
                            frequency_penalty=0.3, min_tokens=5)
    assert run(llm, params=params) == run(plain, params=params)
    assert _accepted(llm) > 0


def test_preemption_with_drafts(folder: Path, reference) -> None:
    llm = make_llm(folder, speculative_config=NGRAM, num_gpu_blocks_override=14)
    assert run(llm) == reference
    stats = llm.llm_engine.stats()
    assert stats.num_preemptions > 0
    assert stats.spec_decode_num_accepted_tokens > 0


def test_sampling_runs_and_seeded_requests_are_unchanged(folder: Path, plain) -> None:
    llm = make_llm(folder, speculative_config=NGRAM)
    params = SamplingParams(temperature=0.8, top_k=20, max_tokens=30, ignore_eos=True)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 30 for o in outputs)
    assert_no_leaks(llm)
    assert llm.llm_engine.stats().spec_decode_num_drafts > 0
    # A seeded request never speculates: its tokens depend on seed and position only.
    seeded = SamplingParams(temperature=0.8, max_tokens=20, seed=123)
    assert run(llm, PROMPTS[:3], seeded) == run(plain, PROMPTS[:3], seeded)


def test_steps_mixing_drafts_with_grammars_prompt_logprobs_and_beams(folder: Path,
                                                                      plain) -> None:
    """Requests that never speculate (constrained, beams) and prompt-logprob prefills share
    steps with requests verifying drafts (max_num_seqs 3: later prompts start while earlier
    requests decode); each gets what it gets without speculation."""
    from octavo.sampling_params import BeamSearchParams

    from tests.structured_output.test_engine import check, constrained

    llm = make_llm(folder, speculative_config=NGRAM, max_num_seqs=3)
    core = llm.llm_engine.engine_core
    schedule = core.scheduler.schedule
    beside_drafts: set[str] = set()  # requests scheduled in steps that verified drafts

    def recording_schedule():
        out = schedule()
        if out.scheduled_spec_decode_tokens:
            beside_drafts.update(r for r in out.num_scheduled_tokens
                                 if r not in out.scheduled_spec_decode_tokens)
        return out

    core.scheduler.schedule = recording_schedule
    prompts = [{"prompt_token_ids": p} for p in PROMPTS[:6]]
    params = [greedy(NUM_TOKENS), constrained("json", temperature=0.0), greedy(NUM_TOKENS),
              SamplingParams(temperature=0.0, max_tokens=20, prompt_logprobs=1),
              constrained("regex", temperature=0.0), greedy(NUM_TOKENS)]
    got = llm.generate(prompts, params, use_tqdm=False)
    want = plain.generate(prompts, params, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in got] == [
        list(o.outputs[0].token_ids) for o in want]
    ids = [o.request_id for o in got]
    assert {ids[1], ids[3]} <= beside_drafts  # a grammar row, a prompt-logprob prefill
    check("json", got[1].outputs[0].text)
    check("regex", got[4].outputs[0].text)
    assert len(got[3].prompt_logprobs) == len(want[3].prompt_logprobs) == len(PROMPTS[3])
    for a, b in zip(got[3].prompt_logprobs[1:], want[3].prompt_logprobs[1:]):
        assert set(a) == set(b)
        for token, lp in a.items():
            assert math.isclose(lp.logprob, b[token].logprob, abs_tol=1e-4)
    assert_no_leaks(llm)
    assert _accepted(llm) > 0
    # A beam search beside speculating requests.
    beams = BeamSearchParams(beam_width=2, max_tokens=12)
    expected = plain.beam_search([{"prompt_token_ids": PROMPTS[3]}], beams)
    llm.llm_engine.add_request("spec", {"prompt_token_ids": PROMPTS[0]}, greedy(NUM_TOKENS))
    beside_drafts.clear()
    got_beams = llm.beam_search([{"prompt_token_ids": PROMPTS[3]}], beams)
    assert [s.tokens for s in got_beams[0].sequences] == [s.tokens for s in expected[0].sequences]
    assert any(r != "spec" for r in beside_drafts), "no beam shared a step with drafts"
    while llm.llm_engine.has_unfinished_requests():
        llm.llm_engine.step()
    assert_no_leaks(llm)
