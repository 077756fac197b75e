"""Command line: ``python -m sglang_ext <command> ...`` (also the ``sglang-ext`` script).

Each command lives in its own module, which exposes ``add_parser(subparsers)``;
the parser it adds sets ``func`` to a callable taking the parsed args and
returning an exit code.

Only the module of the command being run is imported, so ``extract`` and
``convert`` (the clients, often run on another machine than the server) need
neither the patch tooling nor Python 3.11's ``tomllib``: they run on Python 3.10.
``patches`` on Python 3.10 reads ``base.toml`` with ``tomli`` (the same parser,
a dependency of this package on 3.10).
"""

from __future__ import annotations

import argparse
import importlib
import sys

# command -> (module providing it, one-line help), in the order `--help` lists them.
COMMANDS = {
    "patches": ("sglang_ext.tools.patches", "check/apply/maintain the SGLang patch series"),
    "extract": ("sglang_ext.client.extract", "send a dataset to a dumping server; collect hs_<i>.safetensors"),
    "convert": ("sglang_ext.client.convert", "convert hs_<i>.safetensors to another trainer's format (SpecForge)"),
    "standin": ("sglang_ext.tools.standin", "a stand-in server (no GPU, no model) for trying extract"),
}


def _provide_tomllib() -> None:
    """Python 3.10 has no ``tomllib``; ``tomli`` is the same package under its PyPI name."""
    if sys.version_info >= (3, 11):
        return
    try:
        import tomli
    except ImportError:
        raise SystemExit("error: `patches` on Python 3.10 needs the tomli package "
                         "(pip install tomli), or Python 3.11 or newer") from None
    sys.modules.setdefault("tomllib", tomli)


def _import_command(name: str):
    if name == "patches":
        _provide_tomllib()
    return importlib.import_module(COMMANDS[name][0])


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The full parser for ``command`` (its module imported); the others are listed by
    name and help only. ``None``: every command's module is imported (all subparsers)."""
    parser = argparse.ArgumentParser(
        prog="sglang-ext",
        description="kimi-sglang tools: patch series, hidden-state extraction.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="{" + ",".join(COMMANDS) + "}")
    for name, (_, helptext) in COMMANDS.items():
        if command is None or name == command:
            _import_command(name).add_parser(sub)
        else:
            sub.add_parser(name, help=helptext, add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = next((a for a in argv if not a.startswith("-")), None)
    try:  # Ctrl-C while the command's module is imported, too: one line, no traceback
        parser = build_parser(command if command in COMMANDS else "")
        args = parser.parse_args(argv)
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        prog = f"sglang-ext {command}" if command in COMMANDS else "sglang-ext"
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader went away (`... | head`): nothing more to say
        sys.stderr.close()
        return 141


if __name__ == "__main__":
    sys.exit(main())
