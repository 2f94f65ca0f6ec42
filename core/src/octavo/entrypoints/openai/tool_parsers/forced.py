"""Calls forced by ``tool_choice``: the answer is JSON that the structured-output engine shaped.

With ``tool_choice: "required"`` the model writes an array of ``{"name", "arguments"}``
objects (at least one; at most one without ``parallel_tool_calls``); with a named function it
writes one such object, its name fixed. ``octavo.entrypoints.openai.tool_calling`` builds the
JSON schema of that output; this parser reads it back, streamed or whole, like any other.
"""

from __future__ import annotations

from octavo.entrypoints.openai.tool_parsers.base import ToolParser


class JsonToolCallsParser(ToolParser):
    """The whole answer is one call object or an array of them (not a ``--tool-call-parser``)."""

    name = "json"

    def _step(self, final: bool) -> bool:
        if self._json_state == "end":
            self._content(self._buffer)  # nothing is expected after the JSON value
            self._buffer = ""
            return False
        return self._step_json_calls(final)
