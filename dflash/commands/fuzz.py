"""``dflash fuzz --seconds N [...]``: the geometry fuzz campaign (``python -m fuzz``).

The harnesses, the oracle and the seed corpus live in the source tree's ``fuzz/``
package (next to ``specs/``, the oracle). This command finds that tree next to the
installed ``dflash`` package (an editable install or a checkout) and runs the campaign
in a child process, so Atheris' libFuzzer never shares this process.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import dflash
from dflash.commands.output import check_output_file

# engine -> the packages it needs (all installed by ``pip install 'dflash[fuzz]'``)
ENGINE_PACKAGES = {"atheris": ("atheris",), "hypothesis": ("hypothesis",)}


def source_root() -> Path | None:
    """The checkout holding ``fuzz/`` and ``specs/``, or None for a plain install."""
    root = Path(dflash.__file__).resolve().parent.parent
    needed = (root / "fuzz" / "campaign.py", root / "specs" / "geometry_spec.py")
    return root if all(path.is_file() for path in needed) else None


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "fuzz", help="fuzz campaign against the geometry validators",
        description="Fuzz both geometry validators with the specification as the oracle; "
                    "writes a JSON report. Exit 1 if any crash was found, 2 if it could not run.")
    parser.add_argument("--seconds", type=float, required=True, help="time budget")
    parser.add_argument("--runs", type=int, default=0,
                        help="stop after this many executions (0, the default: no limit; "
                        "--seconds still ends the campaign)")
    parser.add_argument("--engine", choices=("auto", "atheris", "hypothesis"), default="auto",
                        help="auto (default): atheris when installed, else hypothesis")
    parser.add_argument("--report", type=Path, default=Path("fuzz-report.json"),
                        help="JSON report file (default: fuzz-report.json)")
    parser.add_argument("--corpus", type=Path, default=None,
                        help="corpus directory (grown in place; default: a temporary one)")
    parser.add_argument("--crashes", type=Path, default=None,
                        help="where crash reproducers go (default: fuzz/crashes in the checkout)")
    parser.set_defaults(run=run)


def installed(package: str) -> bool:
    return importlib.util.find_spec(package) is not None


def choose_engine(requested: str) -> str:
    """The engine to run: ``auto`` is atheris when installed, else hypothesis."""
    if requested == "auto":
        return "atheris" if installed("atheris") else "hypothesis"
    return requested


def check_arguments(args: argparse.Namespace) -> str:
    """Everything checkable before the campaign starts; returns the engine to run."""
    if not args.seconds > 0:
        raise ValueError(f"--seconds must be > 0 (got {args.seconds})")
    if args.runs < 0:
        raise ValueError(f"--runs must be >= 0 (got {args.runs})")
    engine = choose_engine(args.engine)
    missing = [name for name in ENGINE_PACKAGES[engine] if not installed(name)]
    if missing:
        raise ValueError(
            f"the {engine} engine needs the {missing[0]!r} package, which is not installed: "
            "pip install 'dflash[fuzz]'"
            + (" (or --engine hypothesis)" if engine == "atheris" else "")
        )
    check_output_file(args.report, "--report")
    for option, folder in (("--corpus", args.corpus), ("--crashes", args.crashes)):
        if folder is not None and folder.exists() and not folder.is_dir():
            raise ValueError(f"{option} must be a directory (got {str(folder)!r}: a file)")
    return engine


def run(args: argparse.Namespace) -> int:
    try:
        engine = check_arguments(args)
    except ValueError as err:  # OutputPathError included
        print(f"dflash fuzz: error: {err}", file=sys.stderr)
        return 2
    root = source_root()
    if root is None:
        print("dflash fuzz: the fuzz harnesses ship in the source tree (fuzz/, specs/); "
              "run this from a checkout with dflash installed in editable mode", file=sys.stderr)
        return 2
    cmd = [sys.executable, "-m", "fuzz", "--seconds", str(args.seconds), "--runs", str(args.runs),
           "--engine", engine, "--report", str(args.report.resolve())]
    if args.corpus is not None:
        cmd += ["--corpus", str(args.corpus.resolve())]
    if args.crashes is not None:
        cmd += ["--crashes", str(args.crashes.resolve())]
    path = os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))
    return run_campaign(cmd, root, {**os.environ, "PYTHONPATH": path})


def run_campaign(cmd: list[str], cwd: Path, env: dict[str, str]) -> int:
    """Run the campaign in its own process group; Ctrl-C ends the whole group quietly.

    The group (the campaign and its Atheris child) does not see the terminal's Ctrl-C, so
    it prints no traceback of its own; this process stops it and re-raises the interrupt
    for the one-line exit of ``dflash``.
    """
    group = hasattr(os, "killpg")
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, start_new_session=group)
    try:
        return proc.wait()
    except KeyboardInterrupt:
        if group:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
        else:  # pragma: no cover - no process groups (Windows)
            proc.terminate()
        proc.wait()
        raise
