"""Tool-call parsers: named ``ToolParser`` classes chosen with ``--tool-call-parser``.

The registry is built from the ``octavo_register_tool_parsers`` hook; Octavo's own parsers
(``hermes``, ``llama3_json``, ``mistral``) come through the same hook
(``octavo.entrypoints.openai.tool_parsers.builtin_plugin``), so a plugin can add formats or
replace a built-in one.
"""

from __future__ import annotations

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
    from octavo.plugins import get_plugin_manager, registered_classes

    pm = get_plugin_manager() if pm is None else pm
    return registered_classes(pm.hook.octavo_register_tool_parsers, "tool-call parser",
                              ToolParser)


def get_tool_parser(name: str, pm: pluggy.PluginManager | None = None) -> type[ToolParser]:
    """The class registered as ``name``; ``ValueError`` naming the choices otherwise."""
    parsers = tool_parsers(pm)
    if name not in parsers:
        raise ValueError(f"unknown tool-call parser {name!r}; choose one of: "
                         f"{', '.join(sorted(parsers))}")
    return parsers[name]
