"""Speculative decoding with a draft model (``"method": "draft_model"``) through ``octavo.LLM``:
greedy outputs (and logprobs) equal those without speculation in every engine situation that
touches the draft's tokens and KV (continuous batching with prefills in the same step, prefix
caching, preemption by recompute and by swap, stops and max_tokens inside an accepted run,
n > 1); the target as its own draft accepts every draft; a prefix-cache hit proposes exactly
what a run without the cache proposes (the draft's KV of cached blocks is valid); bad
configurations are refused with one clear line."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from octavo.engine.arg_utils import EngineArgs
from octavo.sampling_params import SamplingParams

from tests.helpers.engine import (
    assert_no_leaks,
    greedy,
    make_llm,
    record_mixed_spec_steps,
    record_proposals,
    spec_prompts,
    token_ids,
)
from tests.helpers.spec_sampling import assert_second_token_follows_target
from tests.helpers.tiny import make_tiny_model

K = 3
NUM_TOKENS = 40
PROMPTS = spec_prompts()


@pytest.fixture(scope="module")
def folder(tiny_llama: Path) -> Path:
    return tiny_llama


@pytest.fixture(scope="module")
def draft(tmp_path_factory) -> Path:
    """A smaller model of another architecture with the target's vocabulary (one layer,
    hidden 32): its proposals are sometimes right, sometimes wrong."""
    return make_tiny_model(tmp_path_factory.mktemp("draft"), "qwen2", hidden_size=32,
                           intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                           num_key_value_heads=1, seed=3)


def spec(model: Path, k: int = K) -> dict:
    return {"method": "draft_model", "model": str(model), "num_speculative_tokens": k}


@pytest.fixture(scope="module")
def plain(folder: Path):
    return make_llm(folder)


@pytest.fixture(scope="module")
def reference(plain) -> list[list[int]]:
    return token_ids(plain.generate(PROMPTS, greedy(NUM_TOKENS), use_tqdm=False))


def run(llm, prompts=PROMPTS, params=None) -> list[list[int]]:
    ids = token_ids(llm.generate(prompts, params or greedy(NUM_TOKENS), use_tqdm=False))
    assert_no_leaks(llm)
    return ids


@pytest.mark.parametrize("max_num_batched_tokens", [None, 12])
def test_target_as_its_own_draft_accepts_every_draft(folder: Path, reference,
                                                     max_num_batched_tokens) -> None:
    """The same weights propose the target's own argmax: every draft is accepted, also when
    prompts arrive in chunks (12 tokens a step: steps of chunks that do not sample write the
    draft's KV too, or its first proposals would read garbage)."""
    extra = {} if max_num_batched_tokens is None else {
        "max_num_batched_tokens": max_num_batched_tokens, "max_num_seqs": 4}
    llm = make_llm(folder, speculative_config=spec(folder), **extra)
    assert run(llm) == reference
    stats = llm.llm_engine.stats()
    assert stats.spec_decode_num_draft_tokens > 0
    assert stats.spec_decode_num_accepted_tokens == stats.spec_decode_num_draft_tokens
    per_pos = stats.spec_decode_num_accepted_tokens_per_pos
    assert len(per_pos) == K and per_pos[0] == stats.spec_decode_num_drafts
    if max_num_batched_tokens is None:
        # K + 1 tokens per verify step: 40 tokens took about 40 / (K + 1) steps each.
        assert stats.spec_decode_num_drafts <= len(PROMPTS) * math.ceil(NUM_TOKENS / (K + 1))


def test_smaller_draft_greedy_equal_in_a_mixed_batch(folder: Path, draft: Path,
                                                      reference) -> None:
    """A small token budget: prompt chunks share steps with requests verifying drafts."""
    llm = make_llm(folder, speculative_config=spec(draft), max_num_batched_tokens=12,
                   max_num_seqs=4)
    mixed_steps = record_mixed_spec_steps(llm)
    assert run(llm) == reference
    assert mixed_steps, "no step mixed a prefill with draft verification"
    stats = llm.llm_engine.stats()
    assert 0 < stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens
    # Prompt logprobs of chunks that do not sample (steps of prompt chunks only).
    params = SamplingParams(temperature=0.0, max_tokens=8, prompt_logprobs=1)
    got = llm.generate(PROMPTS[:3], params, use_tqdm=False)
    want = make_llm(folder).generate(PROMPTS[:3], params, use_tqdm=False)
    for a, b in zip(got, want):
        assert list(a.outputs[0].token_ids) == list(b.outputs[0].token_ids)
        assert len(a.prompt_logprobs) == len(b.prompt_logprobs)
        for x, y in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]):
            for token, lp in x.items():
                assert math.isclose(lp.logprob, y[token].logprob, abs_tol=1e-4)


def test_prefix_cache_hits_propose_what_a_cold_run_proposes(folder: Path, draft: Path,
                                                            reference) -> None:
    """The draft's KV of blocks found in the prefix cache was written by the draft when those
    blocks were computed: proposals after a hit equal those of a run without the cache."""
    cold = make_llm(folder, speculative_config=spec(draft), enable_prefix_caching=False,
                    max_num_batched_tokens=16)
    cold_seen = record_proposals(cold)
    assert run(cold) == reference
    warm = make_llm(folder, speculative_config=spec(draft), enable_prefix_caching=True,
                    max_num_batched_tokens=16)
    assert run(warm) == reference  # fills the cache
    hits_before = warm.llm_engine.stats().prefix_cache_hits
    warm_seen = record_proposals(warm)
    assert run(warm) == reference  # every prompt's full blocks are hits
    assert warm.llm_engine.stats().prefix_cache_hits > hits_before

    def by_request(seen):
        order: dict[str, list[list[int]]] = {}
        for req_id, proposals in seen:
            order.setdefault(req_id, []).append(proposals)
        return sorted(order.values())

    assert cold_seen and by_request(warm_seen) == by_request(cold_seen)
    # Outputs as prompts: blocks written while drafts were verified are hit too.
    continued = [p + r[:24] for p, r in zip(PROMPTS, reference)]
    expected = run(make_llm(folder), continued, greedy(8))
    assert run(warm, continued, greedy(8)) == expected


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption(folder: Path, draft: Path, reference, mode: str) -> None:
    llm = make_llm(folder, speculative_config=spec(draft), num_gpu_blocks_override=16,
                   preemption_mode=mode, swap_space=0.01)
    assert run(llm) == reference
    stats = llm.llm_engine.stats()
    assert stats.num_preemptions > 0
    assert stats.spec_decode_num_accepted_tokens > 0


def test_max_tokens_and_stop_tokens_cut_inside_a_step(folder: Path, plain,
                                                      reference) -> None:
    """With the target as draft every step emits K + 1 tokens: a max_tokens or a stop token
    falls inside a step's tokens."""
    llm = make_llm(folder, speculative_config=spec(folder))
    for max_tokens in (1, 2, 3, 5, 6):
        assert run(llm, params=greedy(max_tokens)) == [r[:max_tokens] for r in reference]
    cut = 0
    for prompt, ref in zip(PROMPTS, reference):
        stop = ref[5]  # a step emits tokens 1..4, 5..8: the sixth is inside one
        params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, stop_token_ids=[stop])
        want = plain.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        got = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        assert list(got.token_ids) == list(want.token_ids)
        assert (got.finish_reason, got.stop_reason) == (want.finish_reason, want.stop_reason)
        cut += got.stop_reason == stop
    assert cut > 0
    assert_no_leaks(llm)


def test_n_greater_than_one_logprobs_and_sampling(folder: Path, draft: Path, plain) -> None:
    llm = make_llm(folder, speculative_config=spec(draft))
    params = SamplingParams(n=3, temperature=0.0, max_tokens=30)
    got = llm.generate(PROMPTS[:3], params, use_tqdm=False)
    want = plain.generate(PROMPTS[:3], params, use_tqdm=False)
    for a, b in zip(got, want):
        assert [list(o.token_ids) for o in a.outputs] == [list(o.token_ids) for o in b.outputs]
    params = SamplingParams(temperature=0.0, max_tokens=24, logprobs=2)
    got = llm.generate(PROMPTS[:4], params, use_tqdm=False)
    want = plain.generate(PROMPTS[:4], params, use_tqdm=False)
    for a, b in zip(got, want):
        assert list(a.outputs[0].token_ids) == list(b.outputs[0].token_ids)
        for pos_a, pos_b in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            for token, lp in pos_a.items():
                assert math.isclose(lp.logprob, pos_b[token].logprob, abs_tol=1e-4)
    # Sampled requests verify draft-model drafts too (the rejection sampler with q one-hot).
    sampled = SamplingParams(temperature=0.8, top_k=20, max_tokens=30, ignore_eos=True)
    outputs = llm.generate(PROMPTS, sampled, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 30 for o in outputs)
    assert_no_leaks(llm)
    assert llm.llm_engine.stats().spec_decode_num_accepted_tokens > 0


def test_bad_draft_configs_are_refused(folder: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="is not a local model folder"):
        EngineArgs(model=str(folder), speculative_config=spec(tmp_path / "missing"),
                   dtype="float32").create_engine_config()
    other = make_tiny_model(tmp_path / "other-vocab", "llama", vocab_size=500)
    with pytest.raises(ValueError, match=r"vocabulary \(500 tokens\) differs from the target's"):
        EngineArgs(model=str(folder), speculative_config=spec(other),
                   dtype="float32").create_engine_config()
    short = make_tiny_model(tmp_path / "short", "llama", max_position_embeddings=64)
    with pytest.raises(ValueError, match="draft model is too short"):
        EngineArgs(model=str(folder), speculative_config=spec(short),
                   dtype="float32").create_engine_config()
    windowed = make_tiny_model(tmp_path / "swa", "mistral-swa")
    with pytest.raises(ValueError, match="draft model attends further back"):
        EngineArgs(model=str(windowed), speculative_config=spec(folder),
                   dtype="float32").create_engine_config()
    EngineArgs(model=str(windowed), speculative_config=spec(windowed),
               dtype="float32").create_engine_config()  # the same window: accepted
    with pytest.raises(ValueError, match="draft_tensor_parallel_size must be 1"):
        EngineArgs(model=str(folder), dtype="float32", speculative_config={
            **spec(folder), "draft_tensor_parallel_size": 2}).create_engine_config()


class _RecordingGraphRunner:
    """Stands in for the draft's CUDA graphs on the CPU: takes steps of at most K + 2 tokens a
    sequence (the shapes GPUWorker captures for the draft), runs them eagerly, counts them."""

    def __init__(self, drafter) -> None:
        self.drafter = drafter
        self.query_lens: list[int] = []

    def can_run(self, metadata) -> bool:
        return metadata.max_query_len <= K + 2

    def run(self, input_ids, positions, metadata):
        self.query_lens.append(metadata.max_query_len)
        return self.drafter.model(input_ids, positions, self.drafter.kv_caches, metadata)


def test_draft_steps_replay_graphs_where_the_worker_captured_them(folder: Path, draft: Path,
                                                                 reference) -> None:
    """The draft's one-token steps and its first forward after a verifying step go through
    the draft's graph runner when it has one (GPUWorker captures one; checked here with an
    eager stand-in), prompt chunks past its shapes run eagerly; outputs are unchanged."""
    llm = make_llm(folder, speculative_config=spec(draft))
    drafter = llm.llm_engine.engine_core.executor.worker.model_runner.drafter
    drafter.graph_runner = _RecordingGraphRunner(drafter)
    assert run(llm) == reference
    lens = drafter.graph_runner.query_lens
    assert 1 in lens and any(1 < n <= K + 2 for n in lens)
    assert llm.llm_engine.stats().spec_decode_num_accepted_tokens > 0


def test_sampled_drafts_carry_their_distribution(folder: Path, draft: Path) -> None:
    """A sampled request's drafts are drawn from the draft's softmax at its temperature, and
    that distribution is the rejection sampler's q: with the target as its own draft q equals
    the target's p (up to float rounding between batch shapes), so nearly every draft is
    accepted (a one-hot q would accept draft d with probability p(d) only: about sum p^2)."""
    params = SamplingParams(temperature=1.0, max_tokens=30, ignore_eos=True)
    llm = make_llm(folder, speculative_config=spec(folder))
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 30 for o in outputs)
    assert_no_leaks(llm)
    runner = llm.llm_engine.engine_core.executor.worker.model_runner
    assert set(runner._draft_probs) <= set(runner.requests)  # dropped with their requests
    stats = llm.llm_engine.stats()
    assert stats.spec_decode_num_draft_tokens > 50
    assert stats.spec_decode_num_accepted_tokens >= 0.95 * stats.spec_decode_num_draft_tokens
    # A smaller draft: sampled, mixed with greedy requests in the same steps.
    llm = make_llm(folder, speculative_config=spec(draft))
    mixed = [params if i % 2 else greedy(30) for i in range(len(PROMPTS))]
    outputs = llm.generate(PROMPTS, mixed, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 30 for o in outputs)
    assert_no_leaks(llm)
    assert llm.llm_engine.stats().spec_decode_num_accepted_tokens > 0


def test_sampled_tokens_keep_the_target_distribution(folder: Path, draft: Path) -> None:
    """The second token of a sampled request comes from a verifying step (the first from the
    prompt's step, which proposes; max_tokens 3 leaves room for one draft, accepted or
    resampled): over many requests its frequencies match the target's
    marginal ``sum_t1 p(t1) p(t2 | t1)``, computed with transformers on the same weights
    (Pearson's chi-square; cells expecting under 5 draws pooled)."""
    assert_second_token_follows_target(folder, spec(draft, k=2))


def test_sliding_window_target_with_a_windowed_draft(tiny_model_factory) -> None:
    """A target whose KV blocks are freed outside its window, drafted by a model with the same
    window (itself): the draft never reads a freed block, so every draft is accepted, and the
    outputs are the target's."""
    windowed = tiny_model_factory("mistral-swa")
    want = run(make_llm(windowed))
    llm = make_llm(windowed, speculative_config=spec(windowed))
    assert run(llm) == want
    stats = llm.llm_engine.stats()
    assert stats.spec_decode_num_draft_tokens > 0
    assert stats.spec_decode_num_accepted_tokens == stats.spec_decode_num_draft_tokens
    assert llm.llm_engine.engine_core.scheduler.kv_cache_manager.num_window_freed_blocks > 0
