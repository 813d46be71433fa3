"""``dflash fuzz --seconds N [...]``: the geometry fuzz campaign (``python -m fuzz``).

The harnesses, the oracle and the seed corpus live in the source tree's ``fuzz/``
package (next to ``specs/``, the oracle). This command finds that tree next to the
installed ``dflash`` package (an editable install or a checkout) and runs the campaign
in a child process, so Atheris' libFuzzer never shares this process.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import dflash


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
    parser.add_argument("--runs", type=int, default=0, help="stop after this many executions")
    parser.add_argument("--engine", choices=("atheris", "hypothesis"), default="atheris")
    parser.add_argument("--report", type=Path, default=Path("fuzz-report.json"))
    parser.add_argument("--corpus", type=Path, default=None,
                        help="corpus directory (grown in place; default: a temporary one)")
    parser.add_argument("--crashes", type=Path, default=None,
                        help="where crash reproducers go (default: fuzz/crashes in the checkout)")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if args.seconds <= 0:
        print(f"dflash fuzz: --seconds must be > 0 (got {args.seconds})", file=sys.stderr)
        return 2
    root = source_root()
    if root is None:
        print("dflash fuzz: the fuzz harnesses ship in the source tree (fuzz/, specs/); "
              "run this from a checkout with dflash installed in editable mode", file=sys.stderr)
        return 2
    cmd = [sys.executable, "-m", "fuzz", "--seconds", str(args.seconds), "--runs", str(args.runs),
           "--engine", args.engine, "--report", str(args.report.resolve())]
    if args.corpus is not None:
        cmd += ["--corpus", str(args.corpus.resolve())]
    if args.crashes is not None:
        cmd += ["--crashes", str(args.crashes.resolve())]
    path = os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))
    return subprocess.run(cmd, cwd=root, env={**os.environ, "PYTHONPATH": path},
                          check=False).returncode
