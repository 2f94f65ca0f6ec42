"""Fast encoding of the streamed completion and chat chunks that carry only text.

A streamed ``/v1/completions`` or ``/v1/chat/completions`` response is one SSE event per
engine output per choice; most of them carry nothing but new text (no logprobs, no prompt
logprobs, no tool calls or reasoning to split out). Building a pydantic
``CompletionStreamResponse`` per event and serializing it cost more than everything else the
server does per token (docs/benchmarks.md, "HTTP path"); the fields that never change within
a response are encoded once here, and only the text, index and finish reason per event, with
msgspec. The JSON is the one ``CompletionStreamResponse.model_dump_json(exclude={"usage"})``
writes (same keys, same order; ``"usage":null`` too when the request asked for usage), and
for chat the one ``ChatCompletionStreamResponse.model_dump_json`` writes; tests compare them.
"""

from __future__ import annotations

import msgspec

_encode = msgspec.json.encode


class CompletionChunkEncoder:
    """``data: {...}\\n\\n`` events of one streamed completion response."""

    __slots__ = ("_head", "_tail")

    def __init__(self, request_id: str, created: int, model: str, include_usage: bool) -> None:
        """:param include_usage: ``stream_options.include_usage``: every event has ``"usage":
        null`` (the last one, not written here, has the counts)."""
        self._head = (f'data: {{"id":{_encode(request_id).decode()},"object":"text_completion",'
                      f'"created":{int(created)},"model":{_encode(model).decode()},'
                      '"choices":[{"index":')
        self._tail = ',"usage":null}\n\n' if include_usage else '}\n\n'

    def text_chunk(self, index: int, text: str, finish_reason: str | None) -> str:
        """The event of choice ``index`` with ``text`` and no logprobs."""
        finish = "null" if finish_reason is None else _encode(finish_reason).decode()
        return (f'{self._head}{index},"text":{_encode(text).decode()},"logprobs":null,'
                f'"finish_reason":{finish},"prompt_logprobs":null}}]{self._tail}')


class ChatChunkEncoder:
    """``data: {...}\\n\\n`` events of one streamed chat completion response."""

    __slots__ = ("_head", "_tail")

    def __init__(self, request_id: str, created: int, model: str, include_usage: bool) -> None:
        """:param include_usage: ``stream_options.include_usage``: every event has ``"usage":
        null`` (the last one, not written here, has the counts)."""
        self._head = (f'data: {{"id":{_encode(request_id).decode()},'
                      f'"object":"chat.completion.chunk","created":{int(created)},'
                      f'"model":{_encode(model).decode()},"choices":[{{"index":')
        self._tail = ',"usage":null}\n\n' if include_usage else '}\n\n'

    def role_chunk(self, index: int) -> str:
        """The first event of choice ``index``: the assistant role and empty content."""
        return (f'{self._head}{index},"delta":{{"role":"assistant","content":""}},'
                f'"logprobs":null,"finish_reason":null}}]{self._tail}')

    def content_chunk(self, index: int, text: str, finish_reason: str | None) -> str:
        """The event of choice ``index`` with ``text`` (an empty delta when ``text`` is empty)
        and no logprobs."""
        delta = f'{{"content":{_encode(text).decode()}}}' if text else "{}"
        finish = "null" if finish_reason is None else _encode(finish_reason).decode()
        return (f'{self._head}{index},"delta":{delta},"logprobs":null,'
                f'"finish_reason":{finish}}}]{self._tail}')
