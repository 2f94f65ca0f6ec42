"""``llama3_json``: Llama 3.1/3.2/3.3 JSON calls, ``{"name": ..., "parameters": {...}}``.

With JSON-based tool calling a Llama 3 model answers either with plain text or with calls
only: JSON objects separated by ``;``, optionally after the ``<|python_tag|>`` special token.
So text that starts (after whitespace) with the tag or ``{`` is calls, anything else is
content. ``parameters`` and ``arguments`` are both accepted as the arguments' key. A text
that starts like a call but is not one (a JSON answer with no ``name``) is content.
"""

from __future__ import annotations

from octavo.entrypoints.openai.tool_parsers.base import ToolParser

_TAG = "<|python_tag|>"
_START, _CALL, _OBJECT, _BETWEEN, _CONTENT = "start", "call", "object", "between", "content"


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    keeps_special_tokens = True  # <|python_tag|>

    def __init__(self) -> None:
        super().__init__()
        self._state = _START
        # The python tag, while it is held until the first call begins.
        self._tag = ""

    def _step(self, final: bool) -> bool:
        state = self._state
        if state == _START:
            body = self._buffer.lstrip()
            if body.startswith(_TAG):
                self._tag = self._buffer[:len(self._buffer) - len(body) + len(_TAG)]
                self._buffer = body[len(_TAG):]
                self._state = _CALL
                return True
            if not body or (_TAG.startswith(body) and not final):
                return False
            self._state = _CALL if body.startswith("{") else _CONTENT
            return True
        if state == _CALL:
            body = self._buffer.lstrip()
            if not body:
                return False
            self._tag += self._buffer[:len(self._buffer) - len(body)]
            self._buffer = body
            if not body.startswith("{"):
                self._state = _CONTENT  # e.g. python code after the tag
                self._buffer = self._tag + self._buffer
                return True
            self._begin_call(raw=self._tag)
            self._tag = ""
            self._state = _OBJECT
            return True
        if state == _OBJECT:
            if self._read_object():
                self._end_call()
                self._state = _BETWEEN
                return True
            if final and not self.failed:
                self._finish_object()
                if not self.failed:
                    self._end_call()
                    self._state = _BETWEEN
            return False
        if state == _BETWEEN:
            if not self._skip_space():
                return False
            if self._buffer.startswith(";"):
                self._buffer = self._buffer[1:]
                self._state = _CALL
            else:
                self._state = _CONTENT  # text after the calls
            return True
        self._content(self._buffer)  # all content from here on
        self._buffer = ""
        return False
