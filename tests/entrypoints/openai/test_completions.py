"""``/v1/completions`` through the official ``openai`` client: same text as the offline API."""

from __future__ import annotations

import asyncio

import pytest
from octavo.sampling_params import SamplingParams

from tests.entrypoints.openai.conftest import SERVED_NAME, greedy_kwargs

PROMPTS = ["The capital of France is", "Hello world! hello", "def add(a, b):"]


def offline(llm, prompts, max_tokens=12, **kwargs):
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kwargs)
    return llm.generate(prompts, params, use_tqdm=False)


def test_sync_text_and_usage_match_offline(client, offline_llm) -> None:
    expected = offline(offline_llm, PROMPTS[0])[0]
    resp = client.completions.create(model=SERVED_NAME, prompt=PROMPTS[0], **greedy_kwargs())
    assert resp.object == "text_completion" and resp.model == SERVED_NAME
    assert resp.choices[0].text == expected.outputs[0].text
    assert resp.choices[0].finish_reason == "length"
    assert resp.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert resp.usage.completion_tokens == 12
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + 12


def test_stream_equals_non_stream(client, offline_llm) -> None:
    expected = offline(offline_llm, PROMPTS[1])[0]
    stream = client.completions.create(model=SERVED_NAME, prompt=PROMPTS[1], stream=True,
                                       stream_options={"include_usage": True}, **greedy_kwargs())
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == expected.outputs[0].text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and all(f is None for f in finishes[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert chunks[-1].usage.prompt_tokens == len(expected.prompt_token_ids)
    assert all(c.usage is None for c in chunks[:-1])


def test_async_client_stream_and_not(async_client, offline_llm) -> None:
    expected = [o.outputs[0].text for o in offline(offline_llm, PROMPTS)]

    async def run():
        async with async_client:
            full = await async_client.completions.create(model=SERVED_NAME, prompt=PROMPTS[2], **greedy_kwargs())
            stream = await async_client.completions.create(
                model=SERVED_NAME, prompt=PROMPTS[2], stream=True, **greedy_kwargs())
            streamed = "".join([c.choices[0].text async for c in stream])
            return full.choices[0].text, streamed

    full, streamed = asyncio.run(run())
    assert full == streamed == expected[2]


def test_prompt_forms_and_n(client, offline_llm) -> None:
    """A list of strings, token ids and lists of token ids; n > 1 with a seed."""
    expected = offline(offline_llm, PROMPTS)
    resp = client.completions.create(model=SERVED_NAME, prompt=PROMPTS, **greedy_kwargs())
    assert [c.text for c in sorted(resp.choices, key=lambda c: c.index)] == [e.outputs[0].text for e in expected]
    assert resp.usage.prompt_tokens == sum(len(e.prompt_token_ids) for e in expected)
    ids = [e.prompt_token_ids for e in expected]
    one = client.completions.create(model=SERVED_NAME, prompt=ids[0], **greedy_kwargs())
    assert one.choices[0].text == expected[0].outputs[0].text
    many = client.completions.create(model=SERVED_NAME, prompt=ids[:2], **greedy_kwargs())
    assert [c.text for c in many.choices] == [e.outputs[0].text for e in expected[:2]]
    # Seeded sampling with n = 2: the same completions as offline, indexes prompt * n + i.
    sampled = offline_llm.generate(PROMPTS[:2], SamplingParams(n=2, temperature=1.0, seed=7, max_tokens=8),
                                   use_tqdm=False)
    resp = client.completions.create(model=SERVED_NAME, prompt=PROMPTS[:2], n=2, temperature=1.0, seed=7,
                                     max_tokens=8)
    got = {c.index: c.text for c in resp.choices}
    assert got == {p * 2 + c.index: c.text for p, o in enumerate(sampled) for c in o.outputs}
    assert resp.usage.completion_tokens == sum(len(c.token_ids) for o in sampled for c in o.outputs)


def test_echo_logprobs_stop(client, offline_llm) -> None:
    expected = offline(offline_llm, PROMPTS[0], logprobs=2)[0]
    resp = client.completions.create(model=SERVED_NAME, prompt=PROMPTS[0], logprobs=2, echo=True,
                                     **greedy_kwargs())
    choice = resp.choices[0]
    assert choice.text == PROMPTS[0] + expected.outputs[0].text
    n_prompt = len(expected.prompt_token_ids)
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == n_prompt + 12
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    generated = [expected.outputs[0].logprobs[i][t].logprob for i, t in enumerate(expected.outputs[0].token_ids)]
    assert lp.token_logprobs[n_prompt:] == pytest.approx(generated, abs=1e-4)
    assert all(1 <= len(top) <= 3 for top in lp.top_logprobs[1:])
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    # A stop string taken from the greedy text cuts it, in both modes.
    text = expected.outputs[0].text
    stop = text[3:5]
    cut = text[: text.find(stop)]
    resp = client.completions.create(model=SERVED_NAME, prompt=PROMPTS[0], stop=[stop], **greedy_kwargs())
    assert resp.choices[0].text == cut and resp.choices[0].finish_reason == "stop"
    stream = client.completions.create(model=SERVED_NAME, prompt=PROMPTS[0], stop=stop, stream=True,
                                       **greedy_kwargs())
    assert "".join(c.choices[0].text for c in stream) == cut


def test_extra_sampling_fields_match_offline(client, offline_llm) -> None:
    """Every offline sampling field is accepted (through extra_body where openai lacks it)."""
    fields = dict(top_k=5, top_p=0.9, min_p=0.05, repetition_penalty=1.2, presence_penalty=0.5,
                  frequency_penalty=0.3, logit_bias={7: 5.0}, min_tokens=3, seed=11)
    expected = offline_llm.generate(
        PROMPTS[1], SamplingParams(temperature=0.8, max_tokens=10, **fields), use_tqdm=False)[0]
    resp = client.completions.create(
        model=SERVED_NAME, prompt=PROMPTS[1], temperature=0.8, max_tokens=10, seed=11,
        presence_penalty=0.5, frequency_penalty=0.3, top_p=0.9, logit_bias={"7": 5},
        extra_body={"top_k": 5, "min_p": 0.05, "repetition_penalty": 1.2, "min_tokens": 3},
    )
    assert resp.choices[0].text == expected.outputs[0].text
