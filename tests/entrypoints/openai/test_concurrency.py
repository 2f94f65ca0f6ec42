"""64 concurrent streaming requests give the same outputs as run one by one."""

from __future__ import annotations

import asyncio

from octavo.sampling_params import SamplingParams

from tests.entrypoints.openai.conftest import SERVED_NAME, wait_idle

NUM_REQUESTS = 64
WORDS = ["Paris", "Tokyo", "count", "hello", "caf\u00e9", "def", "world", "one"]


def prompt(i: int) -> str:
    # Different lengths and contents, some sharing prefixes (prefix cache hits).
    return f"{WORDS[i % len(WORDS)]} {i} " + " ".join(WORDS[: i % 5 + 1])


def test_64_concurrent_streams_match_one_by_one(server, async_client, offline_llm) -> None:
    max_tokens = [4 + i % 9 for i in range(NUM_REQUESTS)]
    expected = [
        offline_llm.generate(prompt(i), SamplingParams(temperature=0.0, max_tokens=max_tokens[i],
                                                       ignore_eos=True), use_tqdm=False)[0]
        for i in range(NUM_REQUESTS)
    ]

    async def one(i: int) -> tuple[str, int, str | None]:
        if i % 2:
            stream = await async_client.completions.create(
                model=SERVED_NAME, prompt=prompt(i), max_tokens=max_tokens[i], temperature=0.0,
                stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
            text, usage, finish = "", 0, None
            async for chunk in stream:
                if chunk.choices:
                    text += chunk.choices[0].text
                    finish = chunk.choices[0].finish_reason or finish
                if chunk.usage:
                    usage = chunk.usage.completion_tokens
            return text, usage, finish
        stream = await async_client.chat.completions.create(
            model=SERVED_NAME, messages=[{"role": "user", "content": prompt(i)}],
            max_tokens=max_tokens[i], temperature=0.0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        text, usage, finish = "", 0, None
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
                finish = chunk.choices[0].finish_reason or finish
            if chunk.usage:
                usage = chunk.usage.completion_tokens
        return text, usage, finish

    async def run():
        async with async_client:
            return await asyncio.gather(*(one(i) for i in range(NUM_REQUESTS)))

    results = asyncio.run(run())
    for i, (text, usage, finish) in enumerate(results):
        if i % 2:
            want = expected[i].outputs[0].text
        else:
            want = offline_llm.chat([{"role": "user", "content": prompt(i)}],
                                    SamplingParams(temperature=0.0, max_tokens=max_tokens[i], ignore_eos=True),
                                    use_tqdm=False)[0].outputs[0].text
        assert text == want, f"request {i}"
        assert usage == max_tokens[i] and finish == "length", f"request {i}"
    m = wait_idle(server)
    assert m["octavo:kv_cache_usage_perc"] == 0
