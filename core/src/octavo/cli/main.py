"""``octavo``: generate, serve, list backends, benchmark."""

from __future__ import annotations

import argparse
import os
import sys

from octavo.cli.options import ArgumentParser
from octavo.version import __version__

# Exit statuses besides 0, 1 (a user-facing problem) and 2 (a malformed command line).
EXIT_INTERRUPTED = 130  # Ctrl-C (128 + SIGINT), as a shell reports it
EXIT_BROKEN_PIPE = 141  # stdout closed early (`octavo backends | head -3`; 128 + SIGPIPE)


def build_parser() -> ArgumentParser:
    from octavo.cli import backends, bench, generate, serve

    parser = ArgumentParser(
        prog="octavo",
        description="Octavo: LLM inference with pluggable hardware backends. "
        "Run `octavo COMMAND --help` for a command's options.",
    )
    parser.add_argument("--version", action="version", version=f"octavo {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    generate.add_parser(sub)
    serve.add_parser(sub)
    backends.add_parser(sub)
    bench.add_parser(sub)
    _remember_command_parsers(parser)
    return parser


def _remember_command_parsers(parser: ArgumentParser) -> None:
    """Give every (sub-)command's parser a default ``command_parser`` naming itself, so an
    error found after parsing is reported with that command's usage (the innermost wins)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                child.set_defaults(command_parser=child)
                _remember_command_parsers(child)


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(argv)
    except KeyboardInterrupt:
        # Ctrl-C outside the places that report what they had done (octavo generate does).
        print("interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # The reader went away (`| head`): stop quietly. Point stdout at /dev/null so the
        # interpreter's final flush does not fail again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_BROKEN_PIPE


def _main(argv: list[str] | None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        # argparse would report these with the top-level usage; report them with the
        # command's own (`octavo generate --max-token 5` shows `octavo generate`'s usage).
        getattr(args, "command_parser", parser).error(
            f"unrecognized arguments: {' '.join(unknown)}")
    if args.command is None:
        parser.print_help()
        return 2
    from octavo.logger import configure_logging

    configure_logging()
    try:
        return int(args.func(args) or 0)
    except (ValueError, TypeError, FileNotFoundError, RuntimeError) as exc:
        # User-facing problems (bad option, missing model or backend) get one clear line.
        print(f"octavo {args.command}: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
