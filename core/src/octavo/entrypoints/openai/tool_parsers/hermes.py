"""``hermes``: Hermes-style calls, ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``.

The format of Qwen2.5, Qwen3 and NousResearch's Hermes models: each call is one JSON object in
its own ``<tool_call>`` block, after optional content. ``<tool_call>`` is an ordinary (not
special) added token in their tokenizers. A block whose closing tag is missing at the end of
the text is accepted; a block whose JSON is malformed makes the whole text content.
"""

from __future__ import annotations

from octavo.entrypoints.openai.tool_parsers.base import ToolParser

_OPEN, _CLOSE = "<tool_call>", "</tool_call>"
_CONTENT, _OBJECT, _CLOSING = "content", "object", "closing"


class HermesToolParser(ToolParser):
    name = "hermes"

    def __init__(self) -> None:
        super().__init__()
        self._state = _CONTENT

    def _step(self, final: bool) -> bool:
        if self._state == _CONTENT:
            if not self._content_until(_OPEN, final):
                return False
            self._begin_call(raw=_OPEN)
            self._state = _OBJECT
            return True
        if self._state == _OBJECT:
            if self._read_object():
                self._state = _CLOSING
                return True
            if final and not self.failed:
                self._finish_object()
                if not self.failed:
                    self._state = _CLOSING
                    return True
            return False
        # After the object: the closing tag (or the end of the text).
        if not self._skip_space():
            if final:
                self._end_call()
                self._state = _CONTENT
            return False
        if self._buffer.startswith(_CLOSE):
            self._consume(len(_CLOSE))
        elif _CLOSE.startswith(self._buffer) and not final:
            return False
        # Anything else after the object (a missing closing tag): the call ends here.
        self._end_call()
        self._state = _CONTENT
        return True
