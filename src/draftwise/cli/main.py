"""`draftwise` command line: one subcommand per file in this package.

Each subcommand module defines `add_parser(subparsers)` and `run(args) -> int`. Errors that a
user can fix (bad paths, bad values, bad options, unreadable files) are printed as one line on
stderr with exit status 2, argparse's own included.
"""
from __future__ import annotations

import argparse
import importlib
import sys

SUBCOMMANDS = ["generate", "train", "serve", "bench", "check", "import_gguf", "profile"]


class UserError(Exception):
    """An error caused by the user's input: printed as one line, exit status 2."""


class OneLineParser(argparse.ArgumentParser):
    """argparse, with a usage error as one line (naming the option) instead of usage + error."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="draftwise", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name in SUBCOMMANDS:
        try:
            mod = importlib.import_module(f"draftwise.cli.{name}")
        except ModuleNotFoundError as e:
            if e.name == f"draftwise.cli.{name}":
                continue
            raise
        p = mod.add_parser(sub)
        p.set_defaults(_run=mod.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    args.argv = argv  # the command line as given (bench records it in results.json)
    try:
        return int(args._run(args) or 0)
    except KeyboardInterrupt:
        print("draftwise: interrupted", file=sys.stderr)
        return 130
    except (UserError, ValueError, OSError) as e:  # OSError: a file the user named (FileNotFoundError, ...)
        print(f"draftwise {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # (python -m: the package's module, whose UserError the subcommands raise)
    from draftwise.cli.main import main as package_main

    sys.exit(package_main())
