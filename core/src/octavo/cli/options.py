"""How every ``octavo`` command parses its command line.

- ``ArgumentParser``: no abbreviated flags (``--max-token 5`` is an error, not
  ``--max-tokens``), and every option's default shown in ``--help``. Sub-commands made with
  ``add_subparsers`` inherit the class, so the rules hold for all of them.
- ``add_engine_options``: the engine options (``EngineArgs``) plus the vLLM flags users type by
  habit whose meaning is Octavo's default behaviour: accepted, changing nothing.
"""

from __future__ import annotations

import argparse
from typing import Any

from octavo.engine.arg_utils import EngineArgs


class HelpFormatter(argparse.HelpFormatter):
    """Appends ``(default: X)`` to an option's help unless the help already says its default
    or there is nothing to say (no default, or an on/off switch that is off)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        help_text = action.help or ""
        default = action.default
        if ("default" in help_text or not action.option_strings
                or default is None or default is False or default is argparse.SUPPRESS
                or isinstance(action, argparse.BooleanOptionalAction)):
            return help_text
        shown = ":".join(map(str, default)) if isinstance(default, tuple) else default
        return help_text + f" (default: {shown})".replace("%", "%%")


class RawDescriptionHelpFormatter(HelpFormatter, argparse.RawDescriptionHelpFormatter):
    """``HelpFormatter`` that keeps the description's line breaks."""


class ArgumentParser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` with Octavo's rules: no abbreviations, defaults shown."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)


class _Ignore(argparse.Action):
    """A vLLM flag whose meaning is Octavo's default behaviour: accepted, changes nothing."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        return None


def add_engine_options(parser: argparse.ArgumentParser, with_model: bool = True) -> None:
    """Every engine option (``EngineArgs``), then the vLLM habit flags in the same group.

    vLLM flags Octavo takes under the same name with the same meaning are engine options
    already (``--seed``, ``--max-num-batched-tokens``, ``--gpu-memory-utilization``,
    ``--enforce-eager``, ``--tokenizer``, ``--trust-remote-code``, ``--dtype half``).
    """
    group = EngineArgs.add_cli_args(parser, with_model=with_model)
    group.add_argument(
        "--disable-log-requests", nargs=0, action=_Ignore,
        help="accepted for vLLM compatibility and changes nothing: Octavo never logs requests "
        "(`octavo serve --access-log` logs HTTP requests)")
