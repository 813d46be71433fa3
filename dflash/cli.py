"""The ``dflash`` command: a thin dispatcher over :mod:`dflash.commands`.

Each sub-command lives in its own module exposing ``register(subparsers)``; the
module is imported only when its sub-command runs, so ``dflash validate`` never
pays for importing torch.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

# sub-command -> (module under dflash.commands, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "generate": ("generate", "speculative decoding on a target model (the main job)"),
    "validate": (
        "validate",
        "validate a draft parent array; exit 0 accepted, 1 rejected, 2 unusable",
    ),
    "bench": ("bench", "A/B/A comparison of two generation configurations"),
    "fuzz": ("fuzz", "fuzz campaign against the geometry validators"),
}


def build_parser(command: str | None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dflash", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_text) in COMMANDS.items():
        if name == command:
            mod = importlib.import_module(f"dflash.commands.{module}")
            mod.register(sub)
        else:
            sub.add_parser(name, help=help_text)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args_in = list(sys.argv[1:] if argv is None else argv)
    command = next((a for a in args_in if not a.startswith("-")), None)
    parser = build_parser(command if command in COMMANDS else None)
    args = parser.parse_args(args_in)
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    run = getattr(args, "run", None)
    if run is None:  # pragma: no cover - every registered command sets run
        parser.error(f"command {args.command!r} is not available")
    code: int = run(args)
    return code


if __name__ == "__main__":
    sys.exit(main())
