"""Speculative decoding with an EAGLE-1 head (``"method": "eagle"``) through ``octavo.LLM``:
greedy outputs equal those without speculation (a random head: mixed batches of prefills and
verifications, prefix caching, preemption by recompute and swap, max_tokens and stop tokens
inside a step); a head built to be exactly right (``make_exact_eagle_head``) has every draft
accepted; bad heads are refused with one clear line."""

from __future__ import annotations

from pathlib import Path

import pytest
from octavo.engine.arg_utils import EngineArgs
from octavo.sampling_params import SamplingParams
from octavo.testing.eagle_heads import (
    eagle_head_tensors,
    make_attention_free_target,
    make_exact_eagle_head,
    make_tiny_eagle_head,
    write_eagle_head,
)
from transformers import AutoConfig

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
from tests.helpers.tiny import make_tiny_model

K = 3
NUM_TOKENS = 32
PROMPTS = spec_prompts()


@pytest.fixture(scope="module")
def folder(tiny_llama: Path) -> Path:
    return tiny_llama


@pytest.fixture(scope="module")
def head(folder: Path, tmp_path_factory) -> Path:
    return make_tiny_eagle_head(tmp_path_factory.mktemp("eagle"), folder, seed=4)


def spec(model: Path, k: int = K) -> dict:
    return {"method": "eagle", "model": str(model), "num_speculative_tokens": k}


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


@pytest.fixture(scope="module")
def exact(tmp_path_factory) -> tuple[Path, Path]:
    """An attention-free one-layer target and the head that is exactly right for it."""
    target = make_attention_free_target(tmp_path_factory.mktemp("free"), seed=2)
    return target, make_exact_eagle_head(tmp_path_factory.mktemp("exact"), target)


def test_exact_head_has_every_draft_accepted(exact: tuple[Path, Path]) -> None:
    target, head = exact
    want = run(make_llm(target))
    llm = make_llm(target, speculative_config=spec(head), max_num_batched_tokens=16)
    assert run(llm) == want
    stats = llm.llm_engine.stats()
    assert stats.spec_decode_num_draft_tokens > 0
    assert stats.spec_decode_num_accepted_tokens == stats.spec_decode_num_draft_tokens


def test_max_tokens_and_stop_tokens_cut_inside_a_step(exact: tuple[Path, Path]) -> None:
    """Every draft is accepted, so a step emits K + 1 tokens: cuts fall inside steps."""
    target, head = exact
    plain = make_llm(target)
    reference = run(plain)
    llm = make_llm(target, speculative_config=spec(head))
    for max_tokens in (1, 2, 3, 5, 6):
        assert run(llm, params=greedy(max_tokens)) == [r[:max_tokens] for r in reference]
    for prompt, ref in zip(PROMPTS, reference):
        params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, stop_token_ids=[ref[5]])
        want = plain.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        got = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        assert list(got.token_ids) == list(want.token_ids)
        assert (got.finish_reason, got.stop_reason) == (want.finish_reason, want.stop_reason)
    assert_no_leaks(llm)


def test_bad_heads_are_refused(folder: Path, head: Path, tmp_path: Path) -> None:
    """At start-up (EngineArgs), before any worker loads anything."""
    config = AutoConfig.from_pretrained(folder)
    tensors = eagle_head_tensors(config)
    del tensors["fc.weight"]
    no_fc = write_eagle_head(tmp_path / "no-fc", config, tensors)
    with pytest.raises(ValueError, match="has no 'fc.weight'"):
        EngineArgs(model=str(folder), speculative_config=spec(no_fc),
                   dtype="float32").create_engine_config()
    config.hidden_size, config.head_dim = 32, 8
    narrow = write_eagle_head(tmp_path / "narrow", config, eagle_head_tensors(config))
    with pytest.raises(ValueError, match="hidden size 32, the target 64"):
        EngineArgs(model=str(folder), speculative_config=spec(narrow),
                   dtype="float32").create_engine_config()
    qwen3 = make_tiny_model(tmp_path / "qwen3", "qwen3")
    with pytest.raises(ValueError, match="runs with Llama-architecture targets"):
        EngineArgs(model=str(qwen3), speculative_config=spec(head),
                   dtype="float32").create_engine_config()
    with pytest.raises(ValueError, match="method 'eagle' needs \"model\""):
        EngineArgs(model=str(folder), speculative_config={"method": "eagle",
                   "num_speculative_tokens": 2}).create_engine_config()
    with pytest.raises(ValueError, match="is not a local model folder"):
        EngineArgs(model=str(folder), speculative_config=spec(tmp_path / "missing"),
                   dtype="float32").create_engine_config()


def test_head_reads_the_targets_hidden_state_of_each_position(folder: Path, head: Path,
                                                              reference) -> None:
    """Every row the head gets after a step (chunked prompt, verified tokens, accepted
    drafts) is token t + 1 with the target's hidden state at t, checked against the target
    run once over the whole finished sequence."""
    import torch
    from octavo.attention.base import AttentionMetadata
    from octavo.attention.reference import ReferenceAttentionBackend
    from octavo.model_executor.models import builtin_registry
    from safetensors.torch import load_file

    llm = make_llm(folder, speculative_config=spec(head), max_num_batched_tokens=12)
    drafter = llm.llm_engine.engine_core.executor.worker.model_runner.drafter
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

    config = AutoConfig.from_pretrained(folder)
    target = builtin_registry().resolve(config.architectures)(config, ReferenceAttentionBackend())
    target.load_weights(load_file(str(folder / "model.safetensors")).items())
    attn = target.model.layers["0"].self_attn
    n = len(sequence)
    caches = [torch.zeros(2, n // 4 + 1, 4, attn.num_kv_heads, attn.head_dim)
              for _ in target.model.layers]
    metadata = AttentionMetadata.from_lists(list(range(n)), [0, n], [n],
                                            [list(range(n // 4 + 1))])
    with torch.inference_mode():
        expected = target.eval()(torch.tensor(sequence), torch.arange(n), caches, metadata)
    covered: set[int] = set()
    for positions, ids, hidden in seen:
        assert ids == [sequence[p + 1] for p in positions]
        torch.testing.assert_close(hidden, expected[positions], atol=1e-4, rtol=1e-4)
        covered.update(positions)
    # Every position the target computed got the head's KV (the last token is never computed).
    assert covered == set(range(n - 1))


def test_sampled_requests_and_n(exact: tuple[Path, Path]) -> None:
    """Sampled requests verify the head's sampled drafts (its q goes to the rejection
    sampler); n > 1 greedy completions equal those without speculation."""
    target, head = exact
    llm = make_llm(target, speculative_config=spec(head))
    sampled = SamplingParams(temperature=0.8, top_k=20, max_tokens=24, ignore_eos=True)
    outputs = llm.generate(PROMPTS, sampled, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 24 for o in outputs)
    assert llm.llm_engine.stats().spec_decode_num_accepted_tokens > 0
    params = SamplingParams(n=3, temperature=0.0, max_tokens=20)
    got = llm.generate(PROMPTS[:3], params, use_tqdm=False)
    want = make_llm(target).generate(PROMPTS[:3], params, use_tqdm=False)
    for a, b in zip(got, want):
        assert [list(o.token_ids) for o in a.outputs] == [list(o.token_ids) for o in b.outputs]
    assert_no_leaks(llm)


def test_head_steps_through_the_graph_module_propose_the_same(folder: Path, head: Path,
                                                              reference) -> None:
    """The module the GPU worker captures for the head gives the proposals of the eager head
    (one-token steps and first forwards after verifying steps go through it)."""
    eager = make_llm(folder, speculative_config=spec(head))
    want = record_proposals(eager)
    assert run(eager) == reference
    llm = make_llm(folder, speculative_config=spec(head))
    drafter = llm.llm_engine.engine_core.executor.worker.model_runner.drafter
    drafter.graph_runner = EagerHeadGraphRunner(drafter, max_tokens=64 * (K + 2), max_query_len=K + 2)
    got = record_proposals(llm)
    assert run(llm) == reference
    lens = drafter.graph_runner.query_lens
    assert 1 in lens and any(1 < n <= K + 2 for n in lens)
    assert want and got == want
