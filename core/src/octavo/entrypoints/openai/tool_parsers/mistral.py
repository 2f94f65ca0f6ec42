"""``mistral``: Mistral calls after the ``[TOOL_CALLS]`` special token.

Two shapes, by tokenizer version: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]``
(a JSON array, v3 tokenizers: Mistral-7B-Instruct-v0.3, Mixtral) and
``[TOOL_CALLS]name[ARGS]{...}`` repeated for each call (v11 and later: Mistral Small 3.x,
Magistral; ``[CALL_ID]id`` may sit between the name and ``[ARGS]``). Content may come before
the first marker. Mistral's chat templates require call ids of 9 letters and digits, so this
parser makes ids of that shape.
"""

from __future__ import annotations

import secrets
import string

from octavo.entrypoints.openai.tool_parsers.base import ToolParser
from octavo.entrypoints.openai.tool_parsers.json_stream import JsonValueScanner

_MARKER, _ARGS, _CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
_ID_ALPHABET = string.ascii_letters + string.digits
# Longest function name (with an optional call id) waited for before [ARGS].
_MAX_NAME_CHARS = 256
_CONTENT, _AFTER_MARKER, _JSON, _NAME, _ARGUMENTS = (
    "content", "after_marker", "json", "name", "arguments")


class MistralToolParser(ToolParser):
    name = "mistral"
    keeps_special_tokens = True  # [TOOL_CALLS], [ARGS], [CALL_ID]

    def __init__(self) -> None:
        super().__init__()
        self._state = _CONTENT
        self._scanner: JsonValueScanner | None = None

    def new_call_id(self) -> str:
        return "".join(secrets.choice(_ID_ALPHABET) for _ in range(9))

    def _step(self, final: bool) -> bool:
        state = self._state
        if state == _CONTENT:
            if not self._content_until(_MARKER, final):
                return False
            self._state = _AFTER_MARKER
            return True
        if state == _AFTER_MARKER:
            if not self._skip_space():
                if final:
                    self._begin_call(raw=_MARKER)
                    self._fail()
                return False
            if self._buffer[0] in "[{":
                self._begin_json_calls()
                self._state = _JSON
            else:
                self._state = _NAME
            return True
        if state == _JSON:
            progressed = self._step_json_calls(final)
            if self._json_state == "end":
                self._state = _CONTENT
                return True
            return progressed
        if state == _NAME:
            return self._step_name(final)
        return self._step_arguments(final)

    def _step_name(self, final: bool) -> bool:
        at = self._buffer.find(_ARGS)
        if at < 0:
            if len(self._buffer) > _MAX_NAME_CHARS or final:
                self._begin_call(raw=_MARKER)
                self._fail()
            return False
        name = self._buffer[:at].split(_CALL_ID)[0].strip()
        raw, self._buffer = _MARKER + self._buffer[:at + len(_ARGS)], self._buffer[at + len(_ARGS):]
        if not name or any(ch.isspace() for ch in name):
            self._begin_call(raw=raw)
            self._fail()
            return False
        self._begin_call(raw=raw, name=name)
        self._scanner = JsonValueScanner()
        self._state = _ARGUMENTS
        return True

    def _step_arguments(self, final: bool) -> bool:
        scanner = self._scanner
        assert scanner is not None, "arguments are read with a scanner"
        if not scanner.first_char and not self._skip_space():
            if final:
                self._fail()
            return False
        end = scanner.feed(self._buffer)
        piece = self._buffer[:end]
        self._consume(end)
        if piece:
            self._arguments(piece)
        if scanner.done or (final and scanner.finish()):
            self._scanner = None
            self._end_call()
            self._state = _CONTENT
            return True
        if final:
            self._fail()
        return False
