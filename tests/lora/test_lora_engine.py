"""Multi-LoRA through ``octavo.LLM`` against Hugging Face transformers + PEFT on the same weights.

One mixed batch of requests of three adapters and none: each request's greedy tokens and
logprobs equal PEFT's (unmerged adapter) on the tiny Llama; prefix caching keeps adapters
apart; LRU eviction with one slot; bad adapters are refused with clear errors and the engine
still serves.
"""

from __future__ import annotations

import math
import shutil

import pytest
import torch
from octavo.errors import InvalidRequestError
from octavo.lora_request import LoRARequest

from tests.helpers.engine import assert_no_leaks, greedy, make_llm

NUM_TOKENS = 12
LOGPROB_ATOL = 2e-4
PROMPTS = [
    "The capital of France is",
    "Once upon a time there was",
    "def add(a, b):\n    return",
]


def _lora(models, name: str) -> LoRARequest:
    lora_id = sorted(models.adapters).index(name) + 1
    return LoRARequest(name, lora_id, str(models.adapters[name]))


class PeftReference:
    """Greedy tokens and per-position log-softmax from transformers (+ PEFT)."""

    def __init__(self, models) -> None:
        from octavo.testing.lora_adapters import peft_reference_model
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(models.model)
        self.models = {name: peft_reference_model(models.model, path)
                       for name, path in models.adapters.items()}
        self.models[None] = peft_reference_model(models.model, None)

    @torch.inference_mode()
    def greedy(self, adapter: str | None, prompt: str) -> tuple[list[int], torch.Tensor]:
        model = self.models[adapter]
        ids = list(self.tokenizer(prompt).input_ids)
        generated: list[int] = []
        logprobs = []
        for _ in range(NUM_TOKENS):
            logits = model(input_ids=torch.tensor([ids + generated])).logits[0, -1]
            logprobs.append(torch.log_softmax(logits.float(), dim=-1))
            generated.append(int(logits.argmax()))
        return generated, torch.stack(logprobs)


@pytest.fixture(scope="module")
def reference(lora_models) -> PeftReference:
    return PeftReference(lora_models)


@pytest.fixture(scope="module")
def llm(lora_models):
    llm = make_llm(lora_models.model, enable_lora=True, max_loras=3, max_lora_rank=16,
                   num_gpu_blocks_override=128, block_size=4)
    yield llm
    llm.llm_engine.shutdown()


def _check_against_reference(outputs, cases, reference) -> None:
    for output, (adapter, prompt) in zip(outputs, cases):
        expected_ids, expected_logprobs = reference.greedy(adapter, prompt)
        completion = output.outputs[0]
        assert completion.token_ids == expected_ids, (adapter, prompt)
        for i, (position, token_id) in enumerate(zip(completion.logprobs, expected_ids)):
            got = position[token_id].logprob
            want = expected_logprobs[i, token_id].item()
            assert math.isclose(got, want, abs_tol=LOGPROB_ATOL), (adapter, prompt, i, got, want)


def test_mixed_batch_matches_peft(llm, lora_models, reference) -> None:
    cases = [("all", PROMPTS[0]), ("qv", PROMPTS[1]), (None, PROMPTS[2]), ("mlp", PROMPTS[0]),
             ("qv", PROMPTS[0]), (None, PROMPTS[0]), ("all", PROMPTS[2]), ("mlp", PROMPTS[1])]
    loras = [None if a is None else _lora(lora_models, a) for a, _ in cases]
    outputs = llm.generate([p for _, p in cases], greedy(NUM_TOKENS, logprobs=0),
                           use_tqdm=False, lora_request=loras)
    assert_no_leaks(llm)
    _check_against_reference(outputs, cases, reference)
    # The adapters change the output (the comparison is not of four identical models).
    same_prompt = [outputs[i].outputs[0].token_ids for i in (0, 3, 4, 5)]
    assert len({tuple(t) for t in same_prompt}) == 4


def test_prefix_cache_is_keyed_by_adapter(llm, lora_models, reference) -> None:
    # A prompt of several full blocks, run under each adapter and none, twice: the second
    # round hits the cache of its own adapter only and still matches PEFT.
    prompt = "Zebras and lions live on the wide plains of the south"
    cases = [("all", prompt), ("qv", prompt), (None, prompt), ("mlp", prompt)]
    loras = [None if a is None else _lora(lora_models, a) for a, _ in cases]
    params = greedy(NUM_TOKENS, logprobs=0)
    for round_ in range(2):
        outputs = llm.generate([p for _, p in cases], params, use_tqdm=False,
                               lora_request=loras)
        _check_against_reference(outputs, cases, reference)
        cached = [out.metrics.num_cached_tokens for out in outputs]
        if round_ == 0:
            # Requests of one step cannot hit each other's blocks; different adapters never.
            assert cached == [0, 0, 0, 0], cached
        else:
            assert all(c > 0 for c in cached), cached
    assert_no_leaks(llm)


def test_same_prompt_other_adapter_does_not_hit_cache(llm, lora_models) -> None:
    prompt = "Red green blue yellow and purple are the colours of the kite"
    first = llm.generate(prompt, greedy(2), use_tqdm=False,
                         lora_request=_lora(lora_models, "qv"))[0]
    other = llm.generate(prompt, greedy(2), use_tqdm=False,
                         lora_request=_lora(lora_models, "mlp"))[0]
    again = llm.generate(prompt, greedy(2), use_tqdm=False,
                         lora_request=_lora(lora_models, "qv"))[0]
    assert first.metrics.num_cached_tokens == 0
    assert other.metrics.num_cached_tokens == 0
    assert again.metrics.num_cached_tokens > 0


def test_lru_eviction_with_one_slot(lora_models, reference) -> None:
    llm = make_llm(lora_models.model, enable_lora=True, max_loras=1, max_lora_rank=16,
                   num_gpu_blocks_override=128)
    try:
        cases = [("all", PROMPTS[0]), ("qv", PROMPTS[1]), ("mlp", PROMPTS[2]), (None, PROMPTS[0]),
                 ("all", PROMPTS[1]), ("qv", PROMPTS[0])]
        loras = [None if a is None else _lora(lora_models, a) for a, _ in cases]
        outputs = llm.generate([p for _, p in cases], greedy(NUM_TOKENS, logprobs=0),
                               use_tqdm=False, lora_request=loras)
        _check_against_reference(outputs, cases, reference)
        assert_no_leaks(llm)
        # One at a time in the slot, the last used one left in it.
        runner = llm.llm_engine.engine_core.executor.worker.model_runner
        assert runner.lora_manager.loaded_ids == [_lora(lora_models, "qv").lora_int_id]
    finally:
        llm.llm_engine.shutdown()


def test_bad_adapters_are_refused_and_engine_serves(llm, lora_models, tmp_path) -> None:
    good = _lora(lora_models, "qv")
    missing = LoRARequest("nope", 10, str(tmp_path / "missing"))
    with pytest.raises(InvalidRequestError, match="no such folder"):
        llm.generate("hi", greedy(2), use_tqdm=False, lora_request=missing)
    no_weights = tmp_path / "no_weights"
    no_weights.mkdir()
    shutil.copy(lora_models.adapters["qv"] / "adapter_config.json", no_weights)
    with pytest.raises(InvalidRequestError, match="adapter_model.safetensors"):
        llm.generate("hi", greedy(2), use_tqdm=False,
                     lora_request=LoRARequest("nw", 11, str(no_weights)))
    with pytest.raises(InvalidRequestError, match="over the engine's max_lora_rank 4"):
        small = make_llm(lora_models.model, enable_lora=True, max_lora_rank=4,
                         num_gpu_blocks_override=32)
        try:
            small.generate("hi", greedy(2), use_tqdm=False,
                           lora_request=_lora(lora_models, "all"))
        finally:
            small.llm_engine.shutdown()
    with pytest.raises(InvalidRequestError, match="already names adapter"):
        llm.generate("hi", greedy(2), use_tqdm=False,
                     lora_request=LoRARequest("other", good.lora_int_id,
                                              str(lora_models.adapters["all"])))
    # Nothing was queued and the engine still serves the good adapter.
    assert_no_leaks(llm)
    out = llm.generate("hi", greedy(2), use_tqdm=False, lora_request=good)
    assert len(out[0].outputs[0].token_ids) == 2


def test_lora_needs_enable_lora(lora_models) -> None:
    llm = make_llm(lora_models.model, num_gpu_blocks_override=32)
    try:
        with pytest.raises(InvalidRequestError, match="--enable-lora"):
            llm.generate("hi", greedy(2), use_tqdm=False,
                         lora_request=_lora(lora_models, "qv"))
    finally:
        llm.llm_engine.shutdown()


def test_n_completions_share_the_adapter(llm, lora_models, reference) -> None:
    # n > 1 forks the first completion's prompt blocks; every completion runs the adapter.
    params = greedy(NUM_TOKENS, n=3, logprobs=0)
    out = llm.generate(PROMPTS[1], params, use_tqdm=False,
                       lora_request=_lora(lora_models, "mlp"))[0]
    expected_ids, _ = reference.greedy("mlp", PROMPTS[1])
    assert [c.token_ids for c in out.outputs] == [expected_ids] * 3
    assert_no_leaks(llm)


def test_adapters_with_speculative_decoding(lora_models, reference) -> None:
    # ngram drafts are verified with the request's adapter: the same tokens as PEFT.
    llm = make_llm(lora_models.model, enable_lora=True, max_loras=3, max_lora_rank=16,
                   num_gpu_blocks_override=128,
                   speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                       "prompt_lookup_min": 1, "prompt_lookup_max": 3})
    try:
        cases = [("all", PROMPTS[0]), (None, PROMPTS[1]), ("qv", PROMPTS[2]), ("mlp", PROMPTS[0])]
        loras = [None if a is None else _lora(lora_models, a) for a, _ in cases]
        outputs = llm.generate([p for _, p in cases], greedy(NUM_TOKENS, logprobs=0),
                               use_tqdm=False, lora_request=loras)
        _check_against_reference(outputs, cases, reference)
        stats = llm.llm_engine.engine_core.scheduler.spec_stats
        assert stats.num_draft_tokens > 0, "no draft was verified"
        assert_no_leaks(llm)
    finally:
        llm.llm_engine.shutdown()
