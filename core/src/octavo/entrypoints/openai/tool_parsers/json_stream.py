"""Reading JSON as it is generated: where a value ends, and tool-call objects field by field.

Both readers are fed text piece by piece and report how much of it they consumed, so a parser
can stream a tool call's arguments as the model writes them. They check structure (nesting,
strings, escapes, the object's keys), not the grammar of every value: a complete value is
checked with ``json.loads`` by whoever needs it parsed.
"""

from __future__ import annotations

import json

_WHITESPACE = " \t\r\n"
# Characters a JSON number or literal (true, false, null) can contain.
_PRIMITIVE_CHARS = frozenset("0123456789+-.eEtruefalsn")


class JsonValueScanner:
    """Finds where one JSON value ends. The caller skips whitespace before the value."""

    __slots__ = ("_depth", "_in_string", "_escape", "_started", "_primitive", "first_char", "done")

    def __init__(self) -> None:
        self._depth = 0
        self._in_string = False
        self._escape = False
        self._started = False
        self._primitive = False
        # The value's first character ('{', '[', '"', or that of a number or literal).
        self.first_char = ""
        self.done = False

    def feed(self, text: str, start: int = 0) -> int:
        """Consume ``text[start:]`` up to the end of the value; return the index just past the
        last character consumed (a number's end is only known from the character after it,
        which is not consumed)."""
        i, n = start, len(text)
        while i < n and not self.done:
            ch = text[i]
            if not self._started:
                self._started = True
                self.first_char = ch
                if ch in "{[":
                    self._depth = 1
                elif ch == '"':
                    self._in_string = True
                else:
                    self._primitive = True
            elif self._in_string:
                if self._escape:
                    self._escape = False
                elif ch == "\\":
                    self._escape = True
                elif ch == '"':
                    self._in_string = False
                    self.done = self._depth == 0
            elif self._primitive:
                if ch not in _PRIMITIVE_CHARS:
                    self.done = True
                    break
            elif ch == '"':
                self._in_string = True
            elif ch in "{[":
                self._depth += 1
            elif ch in "}]":
                self._depth -= 1
                self.done = self._depth == 0
            i += 1
        return i

    def finish(self) -> bool:
        """The text has ended: a number or literal ends with it. True when the value is whole."""
        if self._primitive and self._started:
            self.done = True
        return self.done


class ToolCallObjectReader:
    """Reads one tool-call object, ``{"name": "...", "arguments": {...}}``, incrementally.

    Events come out in ``events`` as ``("name", name)`` once the name is complete, then
    ``("arguments", fragment)`` as the arguments are written (the raw JSON text of an object or
    array value; a string value, i.e. arguments encoded as a JSON string, comes whole and
    decoded). Arguments written before the name are held until the name is known. An object
    with no arguments gives ``"{}"``. Other keys are skipped. ``error`` is set (and reading
    stops) on anything that is not such an object.
    """

    _START, _KEY_OR_END, _KEY, _COLON, _VALUE_START, _VALUE, _COMMA_OR_END = range(7)

    def __init__(self, argument_keys: tuple[str, ...] = ("arguments", "parameters")) -> None:
        self._argument_keys = argument_keys
        self._state = self._START
        self._key_raw = ""
        self._key = ""
        self._scanner: JsonValueScanner | None = None
        self._value_raw = ""
        self._held_arguments: list[str] = []
        self._has_arguments = False
        self.name: str | None = None
        self.events: list[tuple[str, str]] = []
        self.done = False
        self.error: str | None = None

    def feed(self, text: str, start: int = 0) -> int:
        """Consume ``text[start:]`` up to the object's closing brace; return the index past
        the last character consumed."""
        i, n = start, len(text)
        while i < n and not self.done and self.error is None:
            state = self._state
            ch = text[i]
            if state in (self._START, self._KEY_OR_END, self._COLON, self._VALUE_START,
                         self._COMMA_OR_END) and ch in _WHITESPACE:
                i += 1
            elif state == self._START:
                i = self._expect(ch, "{", i, self._KEY_OR_END)
            elif state == self._KEY_OR_END:
                if ch == '"':
                    self._key_raw, self._state = '"', self._KEY
                    i += 1
                elif ch == "}":
                    i += 1
                    self._close()
                else:
                    self.error = f"expected a key or '}}', got {ch!r}"
            elif state == self._KEY:
                i = self._read_key(text, i)
            elif state == self._COLON:
                i = self._expect(ch, ":", i, self._VALUE_START)
            elif state == self._VALUE_START:
                self._scanner, self._value_raw, self._state = JsonValueScanner(), "", self._VALUE
            elif state == self._VALUE:
                i = self._read_value(text, i)
            elif ch == ",":
                self._state = self._KEY_OR_END
                i += 1
            elif ch == "}":
                i += 1
                self._close()
            else:
                self.error = f"expected ',' or '}}' after a value, got {ch!r}"
        return i

    def finish(self) -> None:
        """The text has ended: an object not closed by now is an error."""
        if self._state == self._VALUE and self._scanner is not None and self._scanner.finish():
            self._end_value()
        if not self.done and self.error is None:
            self.error = "the tool call ends before its object is complete"

    # ---- pieces ----------------------------------------------------------------------------

    def _expect(self, ch: str, wanted: str, i: int, next_state: int) -> int:
        if ch != wanted:
            self.error = f"expected {wanted!r}, got {ch!r}"
            return i
        self._state = next_state
        return i + 1

    def _read_key(self, text: str, i: int) -> int:
        scanner = JsonValueScanner()
        scanner.feed(self._key_raw)  # resume: the key so far, opening quote included
        end = scanner.feed(text, i)
        self._key_raw += text[i:end]
        if scanner.done:
            self._key = json.loads(self._key_raw)
            self._state = self._COLON
        return end

    def _read_value(self, text: str, i: int) -> int:
        scanner = self._scanner
        assert scanner is not None, "a value is read with a scanner"
        end = scanner.feed(text, i)
        piece = text[i:end]
        self._value_raw += piece
        if self._key in self._argument_keys and scanner.first_char in "{[" and piece:
            self._has_arguments = True
            self._arguments(piece)
        if scanner.done:
            self._end_value()
        return end

    def _end_value(self) -> None:
        raw, key = self._value_raw, self._key
        self._state = self._COMMA_OR_END
        if key == "name":
            try:
                name = json.loads(raw)
            except ValueError:
                name = None
            if not isinstance(name, str) or not name:
                self.error = f"the tool call's name must be a non-empty string, got {raw}"
                return
            self.name = name
            self.events.append(("name", name))
            for fragment in self._held_arguments:
                self.events.append(("arguments", fragment))
            self._held_arguments.clear()
        elif key in self._argument_keys and not self._has_arguments:
            self._has_arguments = True
            try:
                value = json.loads(raw)
            except ValueError:
                self.error = f"the tool call's arguments are not JSON: {raw}"
                return
            # Arguments given as a JSON string hold the arguments' JSON text.
            self._arguments(value if isinstance(value, str) else "{}" if value is None else raw)

    def _arguments(self, fragment: str) -> None:
        if self.name is None:
            self._held_arguments.append(fragment)
        else:
            self.events.append(("arguments", fragment))

    def _close(self) -> None:
        if self.name is None:
            self.error = "the tool call has no name"
            return
        if not self._has_arguments:
            self.events.append(("arguments", "{}"))
        self.done = True
