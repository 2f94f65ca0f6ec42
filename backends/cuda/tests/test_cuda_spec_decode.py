"""Speculative decoding (ngram, draft_model) on an NVIDIA GPU (run through the device tool;
skipped in CI).

Greedy outputs with speculation equal those without, with drafts accepted, on the CUDA backend
with CUDA graphs on and off: with them on, steps that verify drafts (up to 1 + K query tokens
per sequence) replay graphs of their own shape, and so do steps without drafts and the draft
model's own steps (its graphs are captured beside the target's). The rejection sampler's
output distribution on the device matches the target's.
"""

from __future__ import annotations

import pytest
import torch
from octavo import LLM, SamplingParams
from octavo.spec_decode.rejection_sampler import rejection_sample

from tests.helpers.spec_sampling import chi_square_p_value
from tests.helpers.tiny import make_tiny_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or getattr(torch.version, "hip", None) is not None,
        reason="needs an NVIDIA GPU and a CUDA build of torch",
    ),
]

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3}
PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12] * 4, [20, 21, 22, 23, 24] * 3, [100, 101, 102],
           [40, 41] * 9, list(range(50, 90))]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    # head_dim 64: one the Triton kernels take.
    return make_tiny_model(tmp_path_factory.mktemp("llama"), "llama", hidden_size=256,
                           intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)


@pytest.mark.parametrize("enforce_eager", [False, True])
def test_greedy_equal_with_and_without_ngram(model_dir, enforce_eager: bool) -> None:
    params = [SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=33, ignore_eos=True, logprobs=2)]
    # Two engines on one GPU: a fixed KV pool each (the default would take 90% of the memory).
    plain = LLM(str(model_dir), device="cuda", dtype="float32", num_gpu_blocks_override=512,
                enforce_eager=enforce_eager)
    spec = LLM(str(model_dir), device="cuda", dtype="float32", num_gpu_blocks_override=512,
               enforce_eager=enforce_eager, speculative_config=NGRAM)
    assert not spec.llm_engine.engine_core.async_scheduling  # speculation runs one step at a time
    for p in params:
        want = plain.generate([{"prompt_token_ids": t} for t in PROMPTS], p, use_tqdm=False)
        got = spec.generate([{"prompt_token_ids": t} for t in PROMPTS], p, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
        if p.logprobs:
            for a, b in zip(got, want):
                for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
                    for token, lp in x.items():
                        assert abs(lp.logprob - y[token].logprob) < 1e-3
    stats = spec.llm_engine.stats()
    assert stats.spec_decode_num_accepted_tokens > 0
    # A small token budget: prompt chunks share steps with draft verification.
    small = LLM(str(model_dir), device="cuda", dtype="float32", num_gpu_blocks_override=512,
                enforce_eager=enforce_eager, speculative_config=NGRAM,
                max_num_batched_tokens=16, max_num_seqs=3)
    got = small.generate([{"prompt_token_ids": t} for t in PROMPTS], params[0], use_tqdm=False)
    want = plain.generate([{"prompt_token_ids": t} for t in PROMPTS], params[0], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]


def test_verification_steps_replay_cuda_graphs(model_dir) -> None:
    spec = LLM(str(model_dir), device="cuda", dtype="float32", num_gpu_blocks_override=512,
               max_num_seqs=8, speculative_config=NGRAM)
    graphs = spec.llm_engine.engine_core.executor.worker.model_runner.graph_runner
    assert graphs is not None and graphs.query_lens == [1, 5]
    shapes = []
    original = graphs.run
    graphs.run = lambda ids, pos, md: shapes.append(graphs.shape_for(md)) or original(ids, pos,
                                                                                     md)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    spec.generate([{"prompt_token_ids": t} for t in PROMPTS], params, use_tqdm=False)
    verified = [shape for shape in shapes if shape[1] == 5]
    assert len(verified) >= 5, shapes  # the repetitive prompts accept drafts at every step
    assert spec.llm_engine.stats().spec_decode_num_accepted_tokens > 0


def test_rejection_sampler_distribution_on_the_device() -> None:
    torch.manual_seed(0)
    device = torch.device("cuda")
    p = torch.tensor([0.05, 0.10, 0.40, 0.15, 0.30], device=device)
    q = torch.tensor([0.40, 0.30, 0.05, 0.20, 0.05], device=device)
    trials = 100_000
    draft = torch.multinomial(q, trials, replacement=True)
    rows = torch.stack([p, torch.full_like(p, 0.2)]).repeat(trials, 1)
    drafts = torch.stack([draft, torch.full_like(draft, -1)], dim=1).reshape(-1)
    draft_probs = torch.stack([q, torch.zeros_like(q)]).repeat(trials, 1)
    out = rejection_sample(rows.argmax(1), rows,
                           torch.zeros(2 * trials, dtype=torch.bool, device=device), drafts,
                           [1] * trials, draft_probs=draft_probs)
    counts = torch.bincount(out.token_ids[:, 0], minlength=5).cpu()
    assert chi_square_p_value(counts, p.cpu()) > 1e-3


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory):
    """A smaller draft of the same vocabulary (another architecture, one layer, head_dim 64)."""
    return make_tiny_model(tmp_path_factory.mktemp("draft"), "qwen2", hidden_size=128,
                           intermediate_size=256, num_hidden_layers=1, num_attention_heads=2,
                           num_key_value_heads=1, seed=3)


@pytest.mark.parametrize("enforce_eager", [False, True])
def test_greedy_equal_with_and_without_draft_model(model_dir, draft_dir,
                                                   enforce_eager: bool) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    prompts = [{"prompt_token_ids": t} for t in PROMPTS]
    plain = LLM(str(model_dir), device="cuda", dtype="float32", num_gpu_blocks_override=512,
                enforce_eager=enforce_eager)
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    # The target as its own draft: every draft accepted.
    self_draft = LLM(str(model_dir), device="cuda", dtype="float32",
                     num_gpu_blocks_override=512, enforce_eager=enforce_eager,
                     speculative_config={"method": "draft_model", "model": str(model_dir),
                                         "num_speculative_tokens": 3})
    got = self_draft.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == want
    stats = self_draft.llm_engine.stats()
    assert stats.spec_decode_num_draft_tokens > 0
    assert stats.spec_decode_num_accepted_tokens == stats.spec_decode_num_draft_tokens
    # Sampled drafts carry the draft's q: with the target as draft, q ~ p, nearly all accepted.
    sampled = SamplingParams(temperature=1.0, max_tokens=40, ignore_eos=True)
    outputs = self_draft.generate(prompts, sampled, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 40 for o in outputs)
    after = self_draft.llm_engine.stats()
    drafted = after.spec_decode_num_draft_tokens - stats.spec_decode_num_draft_tokens
    accepted = after.spec_decode_num_accepted_tokens - stats.spec_decode_num_accepted_tokens
    assert drafted > 0 and accepted >= 0.9 * drafted
    del self_draft
    # A smaller draft, prefix caching on, a small token budget (prefills beside verification).
    small = LLM(str(model_dir), device="cuda", dtype="float32", num_gpu_blocks_override=512,
                enforce_eager=enforce_eager, enable_prefix_caching=True,
                max_num_batched_tokens=16, max_num_seqs=3,
                speculative_config={"method": "draft_model", "model": str(draft_dir),
                                    "num_speculative_tokens": 3})
    for _ in range(2):  # the second run hits the prefix cache
        got = small.generate(prompts, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in got] == want
    stats = small.llm_engine.stats()
    assert stats.prefix_cache_hits > 0
    assert stats.spec_decode_num_draft_tokens > 0
