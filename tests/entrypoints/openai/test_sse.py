"""The fast SSE encoders write what pydantic's ``CompletionStreamResponse`` and
``ChatCompletionStreamResponse`` write."""

from __future__ import annotations

import json

import pytest
from octavo.entrypoints.openai.protocol import (
    ChatCompletionStreamChoice,
    ChatCompletionStreamResponse,
    CompletionChoice,
    CompletionStreamResponse,
    DeltaMessage,
)
from octavo.entrypoints.openai.sse import ChatChunkEncoder, CompletionChunkEncoder

TEXTS = ["", "hello", ' "quoted" \\ back/slash', "caf\u00e9 \u4f60\u597d \U0001f600", "\n\t\r\x00\x1f\x7f",
         "\ufffd", "</script>"]


@pytest.mark.parametrize("include_usage", [False, True])
@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("finish", [None, "stop", "length"])
def test_text_chunk_is_the_pydantic_chunk(text, finish, include_usage):
    request_id, created, model = 'cmpl-"x"\u00e9', 1_700_000_000, "org/model \u00e9"
    encoder = CompletionChunkEncoder(request_id, created, model, include_usage)
    fast = encoder.text_chunk(3, text, finish)
    reference = CompletionStreamResponse(
        id=request_id, created=created, model=model,
        choices=[CompletionChoice(index=3, text=text, finish_reason=finish)],
    ).model_dump_json(exclude=None if include_usage else {"usage"})
    assert fast.startswith("data: ") and fast.endswith("\n\n")
    body = fast[len("data: "):-2]
    assert json.loads(body) == json.loads(reference)
    assert list(json.loads(body)) == list(json.loads(reference))  # same key order
    assert body == reference  # byte for byte, as it happens


def _same_bytes(fast: str, reference: str) -> None:
    assert fast.startswith("data: ") and fast.endswith("\n\n")
    body = fast[len("data: "):-2]
    assert json.loads(body) == json.loads(reference)
    assert body == reference  # byte for byte: same keys, same order, same escapes


@pytest.mark.parametrize("include_usage", [False, True])
@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("finish", [None, "stop", "length"])
def test_chat_content_chunk_is_the_pydantic_chunk(text, finish, include_usage):
    request_id, created, model = 'chatcmpl-"x"\u00e9', 1_700_000_000, "org/model \u00e9"
    encoder = ChatChunkEncoder(request_id, created, model, include_usage)
    # What serving_chat built before: an empty delta when the text is empty.
    delta = DeltaMessage(content=text) if text else DeltaMessage()
    reference = ChatCompletionStreamResponse(
        id=request_id, created=created, model=model,
        choices=[ChatCompletionStreamChoice(index=2, delta=delta, finish_reason=finish)],
    ).model_dump_json(exclude=None if include_usage else {"usage"})
    _same_bytes(encoder.content_chunk(2, text, finish), reference)


@pytest.mark.parametrize("include_usage", [False, True])
def test_chat_role_chunk_is_the_pydantic_chunk(include_usage):
    encoder = ChatChunkEncoder("chatcmpl-1", 1_700_000_000, "m", include_usage)
    reference = ChatCompletionStreamResponse(
        id="chatcmpl-1", created=1_700_000_000, model="m",
        choices=[ChatCompletionStreamChoice(
            index=1, delta=DeltaMessage(role="assistant", content=""))],
    ).model_dump_json(exclude=None if include_usage else {"usage"})
    _same_bytes(encoder.role_chunk(1), reference)
