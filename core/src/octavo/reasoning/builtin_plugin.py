"""Octavo's own reasoning parsers, registered through the same hook as third-party ones.

``tryfirst``: pluggy calls it before every plugin's, and a later ``register`` of a name
replaces an earlier one, so an installed plugin can replace a built-in parser.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from octavo.hookspecs import hookimpl


@hookimpl(tryfirst=True)
def octavo_register_reasoning_parsers(register: Callable[[str, type[Any]], None]) -> None:
    from octavo.reasoning.deepseek_r1 import DeepSeekR1ReasoningParser
    from octavo.reasoning.qwen3 import Qwen3ReasoningParser

    for parser_cls in (DeepSeekR1ReasoningParser, Qwen3ReasoningParser):
        register(parser_cls.name, parser_cls)
