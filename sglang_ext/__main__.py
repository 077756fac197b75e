"""Command line: ``python -m sglang_ext <command> ...`` (also the ``sglang-ext`` script).

Each command lives in its own module, which exposes ``add_parser(subparsers)``;
the parser it adds sets ``func`` to a callable taking the parsed args and
returning an exit code.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# Modules that provide a subcommand, in the order `--help` lists them.
COMMAND_MODULES = [
    "sglang_ext.patches",
    "sglang_ext.client",
    "sglang_ext.convert",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sglang-ext",
        description="kimi-sglang tools: patch series, hidden-state extraction.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for name in COMMAND_MODULES:
        importlib.import_module(name).add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
