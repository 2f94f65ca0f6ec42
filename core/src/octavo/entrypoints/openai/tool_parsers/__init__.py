"""Tool-call parsers: named ``ToolParser`` classes chosen with ``--tool-call-parser``.

The registry is built from the ``octavo_register_tool_parsers`` hook; Octavo's own parsers
(``hermes``, ``llama3_json``, ``mistral``) come through the same hook
(``octavo.entrypoints.openai.tool_parsers.builtin_plugin``), so a plugin can add formats or
replace a built-in one.
"""

from __future__ import annotations

from typing import Any

import pluggy

from octavo.entrypoints.openai.tool_parsers.base import (
    ExtractedToolCalls,
    ToolCall,
    ToolCallDelta,
    ToolParser,
    ToolParserDelta,
)

__all__ = [
    "ExtractedToolCalls",
    "ToolCall",
    "ToolCallDelta",
    "ToolParser",
    "ToolParserDelta",
    "get_tool_parser",
    "tool_parsers",
]


def tool_parsers(pm: pluggy.PluginManager | None = None) -> dict[str, type[ToolParser]]:
    """Every registered tool-call parser by name (a later registration of a name wins)."""
    if pm is None:
        from octavo.plugins import get_plugin_manager

        pm = get_plugin_manager()
    found: dict[str, type[ToolParser]] = {}

    def register(name: str, parser_cls: Any) -> None:
        if not isinstance(name, str) or not name:
            raise ValueError(f"a tool-call parser needs a non-empty name, got {name!r}")
        if not (isinstance(parser_cls, type) and issubclass(parser_cls, ToolParser)):
            raise TypeError(f"tool-call parser {name!r} must be a subclass of "
                            f"octavo.entrypoints.openai.tool_parsers.ToolParser, got {parser_cls!r}")
        found[name] = parser_cls

    pm.hook.octavo_register_tool_parsers(register=register)
    return found


def get_tool_parser(name: str, pm: pluggy.PluginManager | None = None) -> type[ToolParser]:
    """The class registered as ``name``; ``ValueError`` naming the choices otherwise."""
    parsers = tool_parsers(pm)
    if name not in parsers:
        raise ValueError(f"unknown tool-call parser {name!r}; choose one of: "
                         f"{', '.join(sorted(parsers))}")
    return parsers[name]
