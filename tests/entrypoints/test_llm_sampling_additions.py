"""Sampling additions through ``octavo.LLM``: ``allowed_token_ids``, ``bad_words``,
``truncate_prompt_tokens``, logits processors (``no_repeat_ngram`` against transformers'
``no_repeat_ngram_size``), and ``generation_config.json`` defaults (``--generation-config``)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from octavo.errors import InvalidRequestError
from octavo.sampling_params import SamplingParams

from tests.helpers.engine import assert_no_leaks, greedy, make_llm, random_prompts
from tests.helpers.tiny import write_generation_config

PROMPTS = random_prompts(4, 6, 20, seed=11)


@pytest.fixture(scope="module")
def llm(tiny_llama: Path):
    llm = make_llm(tiny_llama)
    yield llm
    llm.llm_engine.shutdown()


def generate(llm, prompts, params):
    return [list(o.outputs[0].token_ids) for o in llm.generate(
        [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]


def contains(seq: list[int], sub: list[int]) -> bool:
    return any(seq[i:i + len(sub)] == sub for i in range(len(seq) - len(sub) + 1))


def test_allowed_token_ids_greedy_and_sampled(llm) -> None:
    allowed = [20, 21, 30, 40, 50]
    for params in (greedy(12, allowed_token_ids=allowed),
                   SamplingParams(temperature=1.0, seed=3, max_tokens=12, ignore_eos=True,
                                  allowed_token_ids=allowed)):
        for out in generate(llm, PROMPTS, params):
            assert set(out) <= set(allowed)
    with pytest.raises(InvalidRequestError, match="out of the vocabulary"):
        llm.generate("hi", greedy(2, allowed_token_ids=[10**6]), use_tqdm=False)
    assert_no_leaks(llm)


def test_bad_words_are_never_generated(llm) -> None:
    tokenizer = llm.get_tokenizer()
    base = generate(llm, PROMPTS, greedy(16))
    # A word the model does generate: the text of a token of its greedy output.
    word = next(tokenizer.decode([t]).strip() for out in base for t in out
                if tokenizer.decode([t]).strip().isalpha())
    params = greedy(16, bad_words=[word])
    sequences = llm.llm_engine.processor._bad_words_token_ids(params)
    assert sequences
    outs = generate(llm, PROMPTS, params)
    assert outs != base
    for out in outs:
        assert not any(contains(out, seq) for seq in sequences), (word, sequences, out)
    assert_no_leaks(llm)


def test_truncate_prompt_tokens_keeps_the_last_tokens(llm) -> None:
    prompt = PROMPTS[0]
    out = llm.generate({"prompt_token_ids": prompt}, greedy(6, truncate_prompt_tokens=4),
                       use_tqdm=False)[0]
    assert list(out.prompt_token_ids) == prompt[-4:]
    assert list(out.outputs[0].token_ids) == generate(llm, [prompt[-4:]], greedy(6))[0]
    kept = llm.generate({"prompt_token_ids": prompt}, greedy(2, truncate_prompt_tokens=-1),
                        use_tqdm=False)[0]
    assert list(kept.prompt_token_ids) == prompt  # -1: up to max_model_len


def test_no_repeat_ngram_matches_transformers(llm, tiny_llama: Path) -> None:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    params = greedy(20, logits_processors=[{"name": "no_repeat_ngram",
                                            "kwargs": {"ngram_size": 2}}])
    outs = generate(llm, PROMPTS[:2], params)
    for prompt, out in zip(PROMPTS[:2], outs):
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False,
                          no_repeat_ngram_size=2, min_new_tokens=20, pad_token_id=0)
        assert out == ref[0, len(prompt):].tolist()
    with pytest.raises(InvalidRequestError, match="unknown logits processor"):
        llm.generate("hi", greedy(2, logits_processors=["nope"]), use_tqdm=False)
    assert_no_leaks(llm)


def test_generation_config_defaults(tiny_llama: Path, tmp_path: Path) -> None:
    model = tmp_path / "model"
    shutil.copytree(tiny_llama, model)
    write_generation_config(model, temperature=0.0, top_k=7, eos_token_id=2)
    llm = make_llm(model)
    try:
        defaults = llm.get_default_sampling_params()
        assert (defaults.temperature, defaults.top_k) == (0.0, 7)
        # No params: the model's defaults (greedy), the same as asking for greedy.
        prompt = {"prompt_token_ids": PROMPTS[0]}
        got = llm.generate(prompt, use_tqdm=False)[0].outputs[0].token_ids
        want = llm.generate(prompt, SamplingParams(temperature=0.0, top_k=7),
                            use_tqdm=False)[0].outputs[0].token_ids
        assert list(got) == list(want)
    finally:
        llm.llm_engine.shutdown()
    ignoring = make_llm(model, generation_config="vllm")
    try:
        assert ignoring.get_default_sampling_params().temperature == 1.0
    finally:
        ignoring.llm_engine.shutdown()
