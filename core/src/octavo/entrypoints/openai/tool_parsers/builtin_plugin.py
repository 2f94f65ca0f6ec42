"""Octavo's own tool-call parsers, registered through the same hook as third-party ones.

``tryfirst``: pluggy calls it before every plugin's, and a later ``register`` of a name
replaces an earlier one, so an installed plugin can replace a built-in parser.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from octavo.hookspecs import hookimpl


@hookimpl(tryfirst=True)
def octavo_register_tool_parsers(register: Callable[[str, type[Any]], None]) -> None:
    from octavo.entrypoints.openai.tool_parsers.hermes import HermesToolParser
    from octavo.entrypoints.openai.tool_parsers.llama3_json import Llama3JsonToolParser
    from octavo.entrypoints.openai.tool_parsers.mistral import MistralToolParser

    for parser_cls in (HermesToolParser, Llama3JsonToolParser, MistralToolParser):
        register(parser_cls.name, parser_cls)
