"""``/v1/chat/completions`` through the official ``openai`` client: same text as ``LLM.chat``."""

from __future__ import annotations

import asyncio

from octavo.sampling_params import SamplingParams

from tests.entrypoints.openai.conftest import SERVED_NAME, greedy_kwargs

MESSAGES = [
    {"role": "system", "content": "You count."},
    {"role": "user", "content": "one, two,"},
    {"role": "assistant", "content": "three"},
    {"role": "user", "content": "Hello world!"},
]


def offline_chat(llm, messages, max_tokens=12, **kwargs):
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kwargs)
    return llm.chat(messages, params, use_tqdm=False)[0]


def test_sync_matches_offline_with_usage(client, offline_llm) -> None:
    expected = offline_chat(offline_llm, MESSAGES)
    resp = client.chat.completions.create(model=SERVED_NAME, messages=MESSAGES, **greedy_kwargs())
    assert resp.object == "chat.completion"
    choice = resp.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == expected.outputs[0].text
    assert choice.finish_reason == "length"
    assert resp.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert resp.usage.completion_tokens == 12


def test_stream_role_first_finish_last_usage(client, offline_llm) -> None:
    expected = offline_chat(offline_llm, MESSAGES)
    stream = client.chat.completions.create(
        model=SERVED_NAME, messages=MESSAGES, stream=True, stream_options={"include_usage": True},
        **greedy_kwargs())
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    with_choices = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].delta.content or "" for c in with_choices) == expected.outputs[0].text
    assert with_choices[-1].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in with_choices[:-1])
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage.prompt_tokens == len(expected.prompt_token_ids)
    assert usage.completion_tokens == 12 and usage.total_tokens == usage.prompt_tokens + 12


def test_async_stream_equals_non_stream(async_client, offline_llm) -> None:
    expected = offline_chat(offline_llm, MESSAGES[-1:], max_tokens=10)

    async def run():
        async with async_client:
            kwargs = greedy_kwargs(10)
            full = await async_client.chat.completions.create(model=SERVED_NAME, messages=MESSAGES[-1:], **kwargs)
            stream = await async_client.chat.completions.create(
                model=SERVED_NAME, messages=MESSAGES[-1:], stream=True, **kwargs)
            parts = [c.choices[0].delta.content or "" async for c in stream if c.choices]
            return full.choices[0].message.content, "".join(parts)

    full, streamed = asyncio.run(run())
    assert full == streamed == expected.outputs[0].text


def test_text_parts_max_completion_tokens_logprobs(client, offline_llm) -> None:
    expected = offline_chat(offline_llm, [{"role": "user", "content": "Hello\nworld"}], max_tokens=6,
                            logprobs=3)
    resp = client.chat.completions.create(
        model=SERVED_NAME,
        messages=[{"role": "user", "content": [{"type": "text", "text": "Hello"},
                                               {"type": "text", "text": "world"}]}],
        temperature=0.0, max_completion_tokens=6, max_tokens=100, logprobs=True, top_logprobs=3,
        extra_body={"ignore_eos": True},
    )
    choice = resp.choices[0]
    assert choice.message.content == expected.outputs[0].text
    assert resp.usage.completion_tokens == 6  # max_completion_tokens wins over max_tokens
    content = choice.logprobs.content
    assert len(content) == 6
    for entry, token_id, position in zip(content, expected.outputs[0].token_ids, expected.outputs[0].logprobs):
        assert abs(entry.logprob - position[token_id].logprob) < 1e-4
        assert len(entry.top_logprobs) == 3
        assert [t.logprob for t in entry.top_logprobs] == sorted((t.logprob for t in entry.top_logprobs), reverse=True)
        assert entry.top_logprobs[0].logprob >= entry.logprob - 1e-6


def test_n_and_stop_stream(client, offline_llm) -> None:
    expected = offline_llm.chat(MESSAGES, SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=8),
                                use_tqdm=False)[0]
    stream = client.chat.completions.create(model=SERVED_NAME, messages=MESSAGES, n=2, temperature=1.0,
                                            seed=3, max_tokens=8, stream=True)
    texts = {0: "", 1: ""}
    roles = []
    for chunk in stream:
        for choice in chunk.choices:
            if choice.delta.role:
                roles.append(choice.index)
            texts[choice.index] += choice.delta.content or ""
    assert sorted(roles) == [0, 1]
    assert texts == {c.index: c.text for c in expected.outputs}


def test_tokenize_uses_the_chat_template(http, offline_llm) -> None:
    tokenizer = offline_llm.get_tokenizer()
    text = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    ids = tokenizer(text, add_special_tokens=False).input_ids
    resp = http.post("/tokenize", json={"model": SERVED_NAME, "messages": MESSAGES})
    assert resp.status_code == 200, resp.text
    assert resp.json()["tokens"] == ids and resp.json()["count"] == len(ids)
    resp = http.post("/tokenize", json={"prompt": "Hello world"})
    assert resp.json()["tokens"] == tokenizer("Hello world").input_ids
    back = http.post("/detokenize", json={"tokens": ids})
    assert back.status_code == 200 and back.json()["prompt"] == tokenizer.decode(ids)
