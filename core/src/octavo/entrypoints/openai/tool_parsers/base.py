"""``ToolParser``: finds the tool calls in what a model wrote, as a whole or as it streams.

A parser is one small state machine per completion. ``feed(piece)`` takes the next piece of
generated text and returns a ``ToolParserDelta``: the plain content it can already give out and
``ToolCallDelta``s (a call's index, id and name first, then fragments of its arguments' JSON
text, in order). ``finish()`` flushes what was held back. ``extract(text)`` runs the same
machine over a whole text, so a streamed response always adds up to the non-streamed one.

A subclass implements ``_step(final)``, consuming ``self._buffer`` from the front with the
helpers below (content up to a marker, a tool-call object, an array of them) and returning
True while it makes progress.

Content around calls: whitespace that separates content from a call is dropped; everything
else outside calls is content. When a call turns out malformed, a parser gives the call's raw
text back as content if none of the call was sent yet; ``extract`` then returns the whole text
as content and no calls (so no half-parsed call reaches a client).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import ClassVar

from octavo.entrypoints.openai.tool_parsers.json_stream import ToolCallObjectReader

_WHITESPACE = " \t\r\n"


@dataclass(slots=True)
class ToolCallDelta:
    """One step of one tool call, as ``delta.tool_calls[i]`` of a streamed chunk carries it."""

    # Position of the call among the completion's calls (0, 1, ...).
    index: int
    # The call's id: in the call's first delta only.
    id: str | None = None
    # The function's name: in the call's first delta only.
    name: str | None = None
    # The next fragment of the arguments' JSON text ("" when there is none yet).
    arguments: str = ""


@dataclass(slots=True)
class ToolParserDelta:
    """What one piece of text adds: plain content and tool-call steps."""

    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def __iadd__(self, other: ToolParserDelta) -> ToolParserDelta:
        self.content += other.content
        for delta in other.tool_calls:
            last = self.tool_calls[-1] if self.tool_calls else None
            if last is not None and last.index == delta.index and delta.id is None:
                last.arguments += delta.arguments  # the same call: one entry
            else:
                self.tool_calls.append(delta)
        return self


@dataclass(slots=True)
class ToolCall:
    """One complete tool call."""

    id: str
    name: str
    # The arguments' JSON text, as the model wrote it.
    arguments: str


@dataclass(slots=True)
class ExtractedToolCalls:
    """The calls found in a whole text and the content around them."""

    # None when there are calls and no other text.
    content: str | None
    tool_calls: list[ToolCall]


@dataclass(slots=True)
class _CallState:
    index: int
    id: str
    name: str | None = None
    arguments: str = ""
    # Something of this call (its name) has been given out.
    sent: bool = False
    # The text of the call as written (marker included), to give back as content if malformed.
    raw: str = ""


class ToolParser:
    """Base of every tool-call parser (``--tool-call-parser NAME``)."""

    # Name given to ``--tool-call-parser``.
    name: ClassVar[str] = ""
    # The format's markers are special tokens: the server then keeps special tokens in the
    # generated text (``skip_special_tokens=False``) so that the parser can see them.
    keeps_special_tokens: ClassVar[bool] = False

    def __init__(self) -> None:
        # Text received and not consumed yet.
        self._buffer = ""
        # Output of the current feed/finish.
        self._out = ToolParserDelta()
        self.calls: list[_CallState] = []
        self._call: _CallState | None = None
        self._reader: ToolCallObjectReader | None = None
        # Whitespace at the end of the content so far: dropped if a call follows.
        self._held_space = ""
        # The last thing seen was a call: the content's next whitespace is dropped.
        self._after_call = False
        # A call was malformed: everything from there on is content.
        self.failed = False
        # Where ``_step_json_calls`` is: "start", "array", "object" or "end".
        self._json_state = "start"
        self._json_in_array = False
        # In an array: an object may come next (at its start, or after a comma).
        self._json_can_add = False

    # ---- public ----------------------------------------------------------------------------

    def feed(self, text: str) -> ToolParserDelta:
        self._buffer += text
        self._run(final=False)
        return self._take()

    def finish(self) -> ToolParserDelta:
        """The text has ended: give out what was held back (a call left open is malformed)."""
        self._run(final=True)
        if self._call is not None:
            self._fail()
        self._content(self._buffer)
        self._buffer = ""
        if not self._after_call:
            self._out.content += self._held_space
        self._held_space = ""
        return self._take()

    @classmethod
    def extract(cls, text: str) -> ExtractedToolCalls:
        """The tool calls of a whole text: all of them, or none (content = the text) when one
        is malformed or its arguments are not a JSON object."""
        parser = cls()
        out = parser.feed(text)
        out += parser.finish()
        calls = [ToolCall(c.id, c.name, c.arguments) for c in parser.calls if c.name is not None]
        if parser.failed or not all(_is_json_object(c.arguments) for c in calls):
            return ExtractedToolCalls(content=text, tool_calls=[])
        if not calls:
            return ExtractedToolCalls(content=out.content, tool_calls=[])
        return ExtractedToolCalls(content=out.content or None, tool_calls=calls)

    def new_call_id(self) -> str:
        """Id of a new call (OpenAI's shape: ``call_`` and 24 hex digits)."""
        return f"call_{uuid.uuid4().hex[:24]}"

    # ---- for subclasses --------------------------------------------------------------------

    def _step(self, final: bool) -> bool:
        """Consume from ``self._buffer``; True when something changed (call again)."""
        raise NotImplementedError(f"{type(self).__name__} must implement _step")

    def _content_until(self, marker: str, final: bool) -> bool:
        """Content up to ``marker``: True once the marker is consumed (the text before it given
        out as content); False when more text is needed (a possible start of the marker at the
        end of the buffer is held back)."""
        at = self._buffer.find(marker)
        if at >= 0:
            self._content(self._buffer[:at])
            self._buffer = self._buffer[at + len(marker):]
            return True
        keep = 0 if final else _partial_suffix(self._buffer, marker)
        self._content(self._buffer[:len(self._buffer) - keep])
        self._buffer = self._buffer[len(self._buffer) - keep:]
        return False

    def _skip_space(self) -> bool:
        """Drop leading whitespace; True when text is left."""
        self._buffer = self._buffer.lstrip(_WHITESPACE)
        return bool(self._buffer)

    def _begin_call(self, raw: str = "", name: str | None = None) -> None:
        """A call starts (its marker, ``raw``, already consumed); ``name`` when known now."""
        assert self._call is None, "a call began inside another"
        self._held_space = ""
        self._call = _CallState(index=len(self.calls), id=self.new_call_id(), raw=raw)
        self.calls.append(self._call)
        if name is not None:
            self._name(name)

    def _read_object(self, argument_keys: tuple[str, ...] = ("arguments", "parameters")) -> bool:
        """Feed the buffer to the current call's object reader: True when the object is
        complete (the call still open: end it with ``_end_call``), False when more text is
        needed or the call failed (``self.failed``)."""
        if self._reader is None:
            self._reader = ToolCallObjectReader(argument_keys)
        reader = self._reader
        end = reader.feed(self._buffer)
        self._consume(end)
        for kind, value in reader.events:
            if kind == "name":
                self._name(value)
            else:
                self._arguments(value)
        reader.events.clear()
        if reader.error is not None:
            self._fail()
            return False
        if reader.done:
            self._reader = None
            return True
        return False

    def _finish_object(self) -> None:
        """The text ended inside the current object: complete it (a trailing number) or fail."""
        if self._reader is not None:
            self._reader.finish()
            self._read_object()

    def _step_json_calls(self, final: bool) -> bool:
        """Calls written as JSON: one object, or an array of objects. Works like ``_step``;
        ``self._json_state`` is ``"end"`` once the value is closed (``_begin_json_calls``
        starts another)."""
        state = self._json_state
        if state == "object":
            if self._read_object():
                self._end_call()
                self._json_state = "array" if self._json_in_array else "end"
                return True
            if final and not self.failed:
                self._finish_object()
                if self.failed:
                    return False
                self._end_call()
                if self._json_in_array:  # the array was never closed
                    self.failed = True
                self._json_state = "end"
            return False
        if state == "end" or not self._skip_space():
            return False
        head = self._buffer[0]
        if state == "start" and head == "[":
            self._buffer = self._buffer[1:]
            self._json_state, self._json_in_array = "array", True
        elif head == "{" and (state == "start" or self._json_can_add):
            self._begin_call()
            self._json_state = "object"
        elif state == "array" and head == "]":
            self._buffer = self._buffer[1:]
            self._json_state = "end"
        elif state == "array" and head == "," and not self._json_can_add:
            self._buffer = self._buffer[1:]
            self._json_can_add = True
            return True
        else:
            self.failed = True
            return False
        self._json_can_add = self._json_state == "array"
        return True

    def _begin_json_calls(self) -> None:
        self._json_state, self._json_in_array, self._json_can_add = "start", False, False

    def _name(self, name: str) -> None:
        call = self._call
        assert call is not None and call.name is None, "a call's name is set once"
        call.name = name
        call.sent = True
        self._out.tool_calls.append(ToolCallDelta(index=call.index, id=call.id, name=name))

    def _arguments(self, fragment: str) -> None:
        call = self._call
        assert call is not None and call.name is not None, "arguments come after the name"
        call.arguments += fragment
        last = self._out.tool_calls[-1] if self._out.tool_calls else None
        if last is not None and last.index == call.index:
            last.arguments += fragment
        else:
            self._out.tool_calls.append(ToolCallDelta(index=call.index, arguments=fragment))

    def _end_call(self) -> None:
        assert self._call is not None, "no call to end"
        if self._call.name is None:  # e.g. a marker with nothing after it
            self._fail()
            return
        self._call = None
        self._reader = None
        self._after_call = True

    def _consume(self, size: int) -> None:
        """Drop the first ``size`` characters of the buffer (part of the current call)."""
        if self._call is not None:
            self._call.raw += self._buffer[:size]
        self._buffer = self._buffer[size:]

    def _fail(self) -> None:
        """The current call is malformed: everything from here on is content; its raw text too
        if nothing of it was given out."""
        self.failed = True
        call, self._call, self._reader = self._call, None, None
        if call is not None and not call.sent:
            self.calls.remove(call)
            self._buffer = call.raw + self._buffer

    # ---- internals -------------------------------------------------------------------------

    def _run(self, final: bool) -> None:
        while not self.failed and self._step(final):
            pass
        if self.failed:
            self._content(self._buffer)
            self._buffer = ""

    def _content(self, text: str) -> None:
        if self._after_call:
            text = text.lstrip(_WHITESPACE)
            if not text:
                return
            self._after_call = False
        text = self._held_space + text
        body = text.rstrip(_WHITESPACE)
        self._held_space = text[len(body):]
        self._out.content += body

    def _take(self) -> ToolParserDelta:
        out, self._out = self._out, ToolParserDelta()
        return out


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that is a proper beginning of ``marker``."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


def _is_json_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False
