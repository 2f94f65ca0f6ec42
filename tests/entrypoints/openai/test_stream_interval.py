"""``octavo serve --stream-interval N``: streams of fewer, larger chunks that still join up to
the offline output, through the official ``openai`` client."""

from __future__ import annotations

import signal

import openai
import pytest

from tests.entrypoints.openai.conftest import API_KEY, SERVED_NAME, ServerProcess, greedy_kwargs
from tests.entrypoints.openai.test_completions import PROMPTS, offline

INTERVAL = 4


@pytest.fixture(scope="module")
def interval_client(tiny_model):
    server = ServerProcess(tiny_model, "--stream-interval", str(INTERVAL), "--async-scheduling")
    try:
        with openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0,
                           timeout=120) as client:
            yield client
    finally:
        assert server.stop(signal.SIGTERM) == 0


def test_completion_chunks_carry_the_interval_and_join_up(interval_client, offline_llm) -> None:
    expected = offline(offline_llm, PROMPTS[1], max_tokens=13, logprobs=0)[0].outputs[0]
    stream = interval_client.completions.create(
        model=SERVED_NAME, prompt=PROMPTS[1], stream=True, logprobs=0, **greedy_kwargs(13))
    chunks = [c.choices[0] for c in stream if c.choices]
    assert "".join(c.text for c in chunks) == expected.text
    # Tokens per chunk, from the chunk's logprobs (one entry per token).
    sizes = [len(c.logprobs.tokens) for c in chunks]
    assert sum(sizes) == 13
    # After the first chunk, at least the interval per chunk, the finish with what is left.
    # (The first token leaves the engine at once, tests/engine/test_output_kinds.py; here a
    # stream that lags a fast tiny model may merge it with later ones, and chunks may merge
    # beyond the interval.)
    assert all(size >= INTERVAL for size in sizes[1:-1])
    assert len(chunks) <= 1 + 12 // INTERVAL + 1
    assert chunks[-1].finish_reason == "length"
    assert all(c.finish_reason is None for c in chunks[:-1])


def test_chat_stream_joins_up_to_the_unstreamed_answer(interval_client) -> None:
    messages = [{"role": "user", "content": "Say something."}]
    whole = interval_client.chat.completions.create(model=SERVED_NAME, messages=messages,
                                                    **greedy_kwargs(14))
    stream = interval_client.chat.completions.create(model=SERVED_NAME, messages=messages,
                                                     stream=True, **greedy_kwargs(14))
    pieces = [c.choices[0].delta.content for c in stream if c.choices and c.choices[0].delta.content]
    assert "".join(pieces) == whole.choices[0].message.content
    assert len(pieces) <= 1 + 13 // INTERVAL + 1


def test_a_stream_interval_below_one_is_refused(tiny_model) -> None:
    with pytest.raises(RuntimeError, match="stream.interval"):
        ServerProcess(tiny_model, "--stream-interval", "0")
