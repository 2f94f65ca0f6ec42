"""Reasoning parsers: named ``ReasoningParser`` classes chosen with ``--reasoning-parser``.

The registry is built from the ``octavo_register_reasoning_parsers`` hook; Octavo's own
parsers (``deepseek_r1``, ``qwen3``) come through the same hook
(``octavo.reasoning.builtin_plugin``), so a plugin can add formats or replace a built-in one.
"""

from __future__ import annotations

import pluggy

from octavo.reasoning.base import ReasoningDelta, ReasoningParser, ReasoningStream

__all__ = [
    "ReasoningDelta",
    "ReasoningParser",
    "ReasoningStream",
    "get_reasoning_parser",
    "reasoning_parsers",
]


def reasoning_parsers(pm: pluggy.PluginManager | None = None) -> dict[str, type[ReasoningParser]]:
    """Every registered reasoning parser by name (a later registration of a name wins)."""
    from octavo.plugins import get_plugin_manager, registered_classes

    pm = get_plugin_manager() if pm is None else pm
    return registered_classes(pm.hook.octavo_register_reasoning_parsers, "reasoning parser",
                              ReasoningParser)


def get_reasoning_parser(name: str, pm: pluggy.PluginManager | None = None) -> type[ReasoningParser]:
    """The class registered as ``name``; ``ValueError`` naming the choices otherwise."""
    parsers = reasoning_parsers(pm)
    if name not in parsers:
        raise ValueError(f"unknown reasoning parser {name!r}; choose one of: "
                         f"{', '.join(sorted(parsers))}")
    return parsers[name]
