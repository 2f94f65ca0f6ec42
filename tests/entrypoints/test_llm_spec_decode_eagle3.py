"""Speculative decoding with an EAGLE-3 head (``"method": "eagle3"``) through ``octavo.LLM``:
greedy outputs equal those without speculation (a random head: mixed batches of prefills and
verifications, prefix caching, preemption by recompute and swap, n > 1, max_tokens and stop
tokens inside a step); a head built to be exactly right (``make_exact_eagle3_head``, for a
target that repeats its current token) has every draft accepted, and none for a token outside
its draft vocabulary; each row the head reads carries the target's auxiliary hidden states of
its position; sampled requests verify drafts drawn from the draft vocabulary's distribution
scattered into the target's, and their tokens keep the target's distribution (chi-square);
bad heads are refused at start-up with one clear line."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from octavo.engine.arg_utils import EngineArgs
from octavo.sampling_params import SamplingParams
from octavo.testing.eagle_heads import (
    default_draft_token_ids,
    eagle3_head_tensors,
    make_exact_eagle3_head,
    make_repeating_target,
    make_tiny_eagle3_head,
    write_eagle3_head,
)
from transformers import AutoConfig, AutoModelForCausalLM

from tests.helpers.engine import (
    EagerHeadGraphRunner,
    assert_no_leaks,
    assert_speculation_survives_caching_and_preemption,
    greedy,
    make_llm,
    record_mixed_spec_steps,
    record_proposals,
    spec_prompts,
    token_ids,
)
from tests.helpers.spec_sampling import assert_second_token_follows_target
from tests.helpers.tiny import VOCAB_SIZE, make_tiny_model

K = 3
NUM_TOKENS = 32
PROMPTS = spec_prompts()
DRAFT_IDS = set(default_draft_token_ids(VOCAB_SIZE))


@pytest.fixture(scope="module")
def folder(tiny_llama: Path) -> Path:
    return tiny_llama


@pytest.fixture(scope="module")
def head(folder: Path, tmp_path_factory) -> Path:
    return make_tiny_eagle3_head(tmp_path_factory.mktemp("eagle3"), folder, seed=4)


def spec(model: Path, k: int = K) -> dict:
    return {"method": "eagle3", "model": str(model), "num_speculative_tokens": k}


@pytest.fixture(scope="module")
def reference(folder: Path) -> list[list[int]]:
    return token_ids(make_llm(folder).generate(PROMPTS, greedy(NUM_TOKENS), use_tqdm=False))


def run(llm, prompts=PROMPTS, params=None) -> list[list[int]]:
    ids = token_ids(llm.generate(prompts, params or greedy(NUM_TOKENS), use_tqdm=False))
    assert_no_leaks(llm)
    return ids


def drafter_of(llm):
    return llm.llm_engine.engine_core.executor.worker.model_runner.drafter


def test_random_head_greedy_equal_in_a_mixed_batch(folder: Path, head: Path,
                                                   reference) -> None:
    llm = make_llm(folder, speculative_config=spec(head), max_num_batched_tokens=12,
                   max_num_seqs=4)
    mixed_steps = record_mixed_spec_steps(llm)
    assert run(llm) == reference
    assert mixed_steps, "no step mixed a prefill with draft verification"
    assert llm.llm_engine.stats().spec_decode_num_draft_tokens > 0


def test_prefix_caching_and_preemption(folder: Path, head: Path, reference) -> None:
    assert_speculation_survives_caching_and_preemption(folder, spec(head), run, reference)


def test_head_reads_the_targets_aux_hidden_states_of_each_position(folder: Path, head: Path,
                                                                   reference) -> None:
    """Every row the head gets after a step (chunked prompt, verified tokens, accepted
    drafts) is token t + 1 with the target's aux states at t (transformers'
    ``hidden_states`` of the head's layers, over the whole finished sequence)."""
    llm = make_llm(folder, speculative_config=spec(head), max_num_batched_tokens=12)
    drafter = drafter_of(llm)
    seen: list[tuple[list[int], list[int], torch.Tensor]] = []
    first_forward = drafter.first_forward

    def recording(batch):
        seen.append((batch.positions.tolist(), batch.input_ids.tolist(),
                     batch.target_hidden.clone()))
        return first_forward(batch)

    drafter.first_forward = recording
    prompt = PROMPTS[0]
    out = run(llm, [prompt])[0]
    assert out == reference[0]
    sequence = prompt + out
    layers = AutoConfig.from_pretrained(head).eagle_aux_hidden_state_layer_ids
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        states = hf(torch.tensor([sequence]), output_hidden_states=True).hidden_states
    expected = torch.cat([states[i][0] for i in layers], dim=-1)
    covered: set[int] = set()
    for positions, ids, hidden in seen:
        assert ids == [sequence[p + 1] for p in positions]
        torch.testing.assert_close(hidden, expected[positions], atol=1e-4, rtol=1e-4)
        covered.update(positions)
    assert covered == set(range(len(sequence) - 1))


@pytest.fixture(scope="module")
def exact(tmp_path_factory) -> tuple[Path, Path]:
    """A target that repeats its current token and the EAGLE-3 head exactly right for it."""
    target = make_repeating_target(tmp_path_factory.mktemp("repeat"), seed=2)
    return target, make_exact_eagle3_head(tmp_path_factory.mktemp("exact3"), target)


def test_exact_head_has_every_draft_accepted(exact: tuple[Path, Path]) -> None:
    target, head = exact
    assert all(p[-1] in DRAFT_IDS for p in PROMPTS), "each output token must be draftable"
    want = run(make_llm(target))
    llm = make_llm(target, speculative_config=spec(head), max_num_batched_tokens=16)
    assert run(llm) == want
    stats = llm.llm_engine.stats()
    assert stats.spec_decode_num_draft_tokens > 0
    assert stats.spec_decode_num_accepted_tokens == stats.spec_decode_num_draft_tokens


def test_token_outside_the_draft_vocabulary_is_never_proposed(exact: tuple[Path, Path]
                                                              ) -> None:
    """The target repeats a token the head cannot propose: every draft is rejected (they are
    target ids of draft tokens), and the outputs are still the target's."""
    target, head = exact
    outside = next(t for t in range(10, VOCAB_SIZE) if t not in DRAFT_IDS)
    prompt = [[7, 9, 11, outside]]
    want = run(make_llm(target), prompt)
    assert set(want[0]) == {outside}
    llm = make_llm(target, speculative_config=spec(head))
    proposals = record_proposals(llm)
    assert run(llm, prompt) == want
    stats = llm.llm_engine.stats()
    assert stats.spec_decode_num_draft_tokens > 0 and stats.spec_decode_num_accepted_tokens == 0
    assert proposals and all(t in DRAFT_IDS for _, p in proposals for t in p)


def test_max_tokens_cut_inside_a_step_and_n(exact: tuple[Path, Path]) -> None:
    """Every draft is accepted, so a step emits K + 1 tokens: max_tokens cuts fall inside
    steps; n > 1 greedy completions equal those without speculation."""
    target, head = exact
    plain = make_llm(target)
    reference = run(plain)
    llm = make_llm(target, speculative_config=spec(head))
    for max_tokens in (1, 2, 3, 5, 6):
        assert run(llm, params=greedy(max_tokens)) == [r[:max_tokens] for r in reference]
    params = SamplingParams(n=3, temperature=0.0, max_tokens=20)
    got = llm.generate(PROMPTS[:3], params, use_tqdm=False)
    want = plain.generate(PROMPTS[:3], params, use_tqdm=False)
    for a, b in zip(got, want):
        assert [list(o.token_ids) for o in a.outputs] == [list(o.token_ids) for o in b.outputs]
    assert_no_leaks(llm)


def test_sampled_requests_verify_the_scattered_draft_distribution(exact: tuple[Path, Path]
                                                                  ) -> None:
    """A sampled request's drafts are drawn from the head's softmax over its draft
    vocabulary, scattered into the target's (zero elsewhere); that q goes to the rejection
    sampler, and drafts are accepted."""
    target, head = exact
    llm = make_llm(target, speculative_config=spec(head))
    drafter = drafter_of(llm)
    qs: list[torch.Tensor] = []
    propose = drafter.propose

    def recording(batch, build):
        proposals, probs = propose(batch, build)
        qs.extend(q.clone() for q in probs.values())
        return proposals, probs

    drafter.propose = recording
    sampled = SamplingParams(temperature=0.8, top_k=20, max_tokens=24, ignore_eos=True)
    outputs = llm.generate(PROMPTS, sampled, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 24 for o in outputs)
    assert llm.llm_engine.stats().spec_decode_num_accepted_tokens > 0
    assert qs
    outside = torch.tensor([t not in DRAFT_IDS for t in range(VOCAB_SIZE)])
    for q in qs:
        assert q.shape[1] == VOCAB_SIZE
        assert not q[:, outside].any()
        torch.testing.assert_close(q.sum(dim=1), torch.ones(q.shape[0]))
    assert_no_leaks(llm)


def test_stop_tokens_cut_inside_a_step(tmp_path: Path) -> None:
    """A target whose outputs alternate between the two tokens of a pair, and the head whose
    first proposal of each step is right: steps emit an accepted draft and a bonus token, and
    a stop token among them cuts the step right after it (as without speculation)."""
    target = make_repeating_target(tmp_path / "pairs", seed=2, swap_pairs=True)
    head = make_exact_eagle3_head(tmp_path / "head", target)
    prompt = [7, 9, 11, 20]  # 20 and 21 alternate; both are draft tokens
    plain = make_llm(target)
    want = run(plain, [prompt])[0]
    assert want[:4] == [21, 20, 21, 20]
    llm = make_llm(target, speculative_config=spec(head))
    assert run(llm, [prompt]) == [want]
    assert llm.llm_engine.stats().spec_decode_num_accepted_tokens > 0
    # The prompt's step emits 21; the next verifies the draft 20 (accepted) and would add a
    # bonus 21 after it: the stop on 20 cuts there.
    stopping = make_llm(target, speculative_config=spec(head))
    params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, stop_token_ids=[20])
    expected = plain.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    got = stopping.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    assert list(got.token_ids) == list(expected.token_ids) == [21, 20]
    assert (got.finish_reason, got.stop_reason) == ("stop", 20)
    stats = stopping.llm_engine.stats()
    assert stats.spec_decode_num_accepted_tokens == 1
    assert_no_leaks(stopping)


def test_sampled_tokens_keep_the_target_distribution(folder: Path, head: Path) -> None:
    """The second token of a sampled request comes from a verifying step (max_tokens 3 leaves
    room for one draft, drawn from the head's q, which is zero outside its draft vocabulary,
    so tokens outside it come only from resampling ``max(0, p - q)``): over many requests its
    frequencies match the target's marginal ``sum_t1 p(t1) p(t2 | t1)``, computed with
    transformers on the same weights (Pearson's chi-square; cells expecting under 5 draws
    pooled)."""
    assert_second_token_follows_target(folder, spec(head, k=2))


def test_head_steps_through_the_graph_module_propose_the_same(exact: tuple[Path, Path]
                                                              ) -> None:
    """The module the GPU worker captures for the head (fc applied before it, on the first
    forward only) gives the proposals of the eager head (the exact head: drafts are
    accepted, so first forwards of several tokens a sequence go through it too)."""
    folder, head = exact
    reference = run(make_llm(folder))
    eager = make_llm(folder, speculative_config=spec(head))
    want = record_proposals(eager)
    assert run(eager) == reference
    llm = make_llm(folder, speculative_config=spec(head))
    drafter = drafter_of(llm)
    drafter.graph_runner = EagerHeadGraphRunner(drafter, max_tokens=64 * (K + 2), max_query_len=K + 2)
    got = record_proposals(llm)
    assert run(llm) == reference
    lens = drafter.graph_runner.query_lens
    assert 1 in lens and any(1 < n <= K + 2 for n in lens)
    assert want and got == want


def _refused(folder: Path, head_folder: Path, message: str) -> None:
    with pytest.raises(ValueError, match=message) as info:
        EngineArgs(model=str(folder), speculative_config=spec(head_folder),
                   dtype="float32").create_engine_config()
    assert "\n" not in str(info.value)


def test_bad_heads_are_refused(folder: Path, head: Path, tmp_path: Path) -> None:
    """At start-up (EngineArgs), before any worker loads anything."""
    config = AutoConfig.from_pretrained(folder)
    layers = [0, 1, 1]

    def write(name: str, edit=lambda t: None, **fields) -> Path:
        tensors = eagle3_head_tensors(config)
        edit(tensors)
        return write_eagle3_head(tmp_path / name, config, tensors, layers, **fields)

    _refused(folder, write("no-d2t", lambda t: t.pop("d2t")),
             "307-token draft vocabulary but no 'd2t'")
    _refused(folder, write("fc", lambda t: t.update(
        {"fc.weight": t["fc.weight"][:, :128].contiguous()})),
        r"expected \[64, 192\] \(three target hidden states of 64\)")
    _refused(folder, write("big", draft_vocab_size=VOCAB_SIZE + 1),
             f"draft vocabulary of {VOCAB_SIZE + 1} tokens, more than the target's")
    _refused(folder, write("deep", eagle_aux_hidden_state_layer_ids=[0, 1, 2]),
             r"reads target layers \[0, 1, 2\], but the target has 2 layers")
    _refused(make_tiny_model(tmp_path / "qwen3", "qwen3"), head,
             "method 'eagle3' runs with Llama-architecture targets")
    with pytest.raises(ValueError, match="method 'eagle3' needs \"model\""):
        EngineArgs(model=str(folder), speculative_config={"method": "eagle3",
                   "num_speculative_tokens": 2}).create_engine_config()


def test_head_runs_past_its_configs_max_position_embeddings(folder: Path, tmp_path: Path,
                                                            reference) -> None:
    """Published EAGLE-3 configs say 2048 positions for 128k-token targets: the head runs at
    the target's positions (as vLLM does), not refused as a too-short draft model."""
    config = AutoConfig.from_pretrained(folder)
    short = write_eagle3_head(tmp_path / "short", config, eagle3_head_tensors(config, seed=4),
                              [0, 1, 1], max_position_embeddings=16)
    llm = make_llm(folder, speculative_config=spec(short))
    assert run(llm, PROMPTS[:2]) == reference[:2]  # prompts of 32 and 15 tokens, 32 more
