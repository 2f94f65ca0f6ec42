"""``octavo``: generate, serve, list backends, benchmark."""

from __future__ import annotations

import argparse
import sys

from octavo.version import __version__


def build_parser() -> argparse.ArgumentParser:
    from octavo.cli import backends, bench, generate, serve

    parser = argparse.ArgumentParser(
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
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
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
