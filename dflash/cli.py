"""The ``dflash`` command: a thin dispatcher over :mod:`dflash.commands`.

Each sub-command lives in its own module exposing ``register(subparsers)``; the
module is imported only when its sub-command runs, so ``dflash validate`` never
pays for importing torch. Help text is shown as plain text (docstring markup such as
double backquotes and roles is removed). Two exits are the same for every command: a
closed stdout (``dflash ... | head``) ends quietly with status 141, Ctrl-C ends with one
line on stderr and status 130.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import os
import re
import sys
import traceback
from collections.abc import Callable, Sequence

DESCRIPTION = "dflash: lossless speculative decoding for hybrid recurrent/attention models"
EXIT_USAGE = 2  # unusable arguments, configuration or checkpoint
EXIT_DECODING = 3  # a failure while decoding (dflash generate / bench)
EXIT_INTERNAL = 4  # any other exception: an internal error (a bug)
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports a process ended by Ctrl-C
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE, as a shell reports `cmd | head` for C tools

_ROLE = re.compile(r":[a-z]+:`~?([^`]+)`")  # :mod:`dflash.x` -> dflash.x
_LITERAL = re.compile(r"``([^`]+)``")  # ``dflash`` -> dflash


def plain_text(text: str) -> str:
    """``text`` without reStructuredText inline markup (roles and double backquotes)."""
    return _LITERAL.sub(r"\1", _ROLE.sub(r"\1", text))


class PlainHelpParser(argparse.ArgumentParser):
    """An argument parser whose help and usage are plain text (sub-parsers inherit it)."""

    def format_help(self) -> str:
        return plain_text(super().format_help())

    def format_usage(self) -> str:
        return plain_text(super().format_usage())

# sub-command -> (module under dflash.commands, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "generate": ("generate", "speculative decoding on a target model (the main job)"),
    "validate": (
        "validate",
        "validate a draft parent array; exit 0 accepted, 1 rejected, 2 unusable",
    ),
    "bench": ("bench", "A/B/A comparison of two generation configurations"),
    "fuzz": ("fuzz", "fuzz campaign against the geometry validators"),
    "train-drafter": ("train_drafter", "train a DFlash drafter (z-lab's format) for a target"),
    "serve": ("serve", "an OpenAI-compatible HTTP server (chat, completions, streaming)"),
    "chat": ("chat", "chat on the terminal (the server's chat template and decode)"),
}


def build_parser(command: str | None) -> argparse.ArgumentParser:
    parser = PlainHelpParser(prog="dflash", description=DESCRIPTION)
    parser.add_argument(
        "--debug",
        action="store_true",
        help="print the traceback of an error (before the command: dflash --debug generate)",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_text) in COMMANDS.items():
        if name == command:
            mod = importlib.import_module(f"dflash.commands.{module}")
            mod.register(sub)
        else:
            sub.add_parser(name, help=help_text)
    return parser


def _quiet_exits(entry: Callable[[Sequence[str] | None], int]) -> Callable[..., int]:
    """Wrap ``entry``: Ctrl-C -> one line, exit 130; a closed stdout -> quiet exit 141."""

    @functools.wraps(entry)
    def wrapper(argv: Sequence[str] | None = None) -> int:
        args_in = list(sys.argv[1:] if argv is None else argv)
        name = next((a for a in args_in if not a.startswith("-")), None)
        prog = "dflash" if name is None else f"dflash {name}"
        try:
            try:
                return entry(argv)
            finally:  # a closed pipe shows here, not in the interpreter's last flush
                sys.stdout.flush()
        except KeyboardInterrupt:
            start = "\n" if sys.stderr.isatty() else ""  # end a progress bar's line first
            print(f"{start}{prog}: interrupted", file=sys.stderr)
            return EXIT_INTERRUPTED
        except BrokenPipeError:
            _silence_stdout()
            return EXIT_BROKEN_PIPE

    return wrapper


def _silence_stdout() -> None:
    """Point stdout at /dev/null so the interpreter's final flush cannot fail again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):  # no real file descriptor (tests, IDEs)
        pass


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


@_quiet_exits
def main(argv: Sequence[str] | None = None) -> int:
    """Run one sub-command; returns its exit status.

    Errors that reach this point: a usage, config or checkpoint error (bad input) exits
    :data:`EXIT_USAGE` with one line; anything else is an internal error (a bug) and exits
    :data:`EXIT_INTERNAL` with one line on stderr; ``dflash --debug ...`` prints the
    traceback too. Commands that decode map their decoding failures to
    :data:`EXIT_DECODING` themselves. Ctrl-C and a closed stdout are left to the wrapper.
    """
    from dflash.errors import CheckpointError, ConfigError, UsageError

    args_in = list(sys.argv[1:] if argv is None else argv)
    command = next((a for a in args_in if not a.startswith("-")), None)
    prog = f"dflash {command}" if command in COMMANDS else "dflash"
    debug = "--debug" in args_in[: args_in.index(command)] if command else "--debug" in args_in
    try:
        parser = build_parser(command if command in COMMANDS else None)
        args = parser.parse_args(args_in)
        debug = bool(args.debug)
        if args.command is None:
            parser.print_help(sys.stderr)
            return EXIT_USAGE
        run = getattr(args, "run", None)
        if run is None:  # pragma: no cover - every registered command sets run
            parser.error(f"command {args.command!r} is not available")
        code: int = run(args)
    except BrokenPipeError:
        raise  # a closed stdout: the quiet exit of the wrapper
    except (UsageError, ConfigError, CheckpointError) as exc:
        if debug:
            traceback.print_exception(exc, file=sys.stderr)
        from dflash.commands.settings import cli_message

        print(f"{prog}: error: {' '.join(cli_message(exc).split())}", file=sys.stderr)
        return EXIT_USAGE
    except Exception as exc:  # an internal error: one line, the traceback only with --debug
        if debug:
            traceback.print_exception(exc, file=sys.stderr)
            print(f"{prog}: internal error: {_one_line(exc)}", file=sys.stderr)
        else:
            print(
                f"{prog}: internal error: {_one_line(exc)} (run `dflash --debug ...` for the "
                "traceback)",
                file=sys.stderr,
            )
        return EXIT_INTERNAL
    return code


if __name__ == "__main__":
    sys.exit(main())
