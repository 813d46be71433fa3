"""``dflash validate [FILE|-] [--tree] [--json]``: check one draft parent array.

Input (a JSON file, or stdin for ``-`` / no FILE): ``{"parents": [...], "n_actual": 4}``
(``n_actual`` optional) or a bare list. Exit codes: 0 accepted, 1 rejected, 2 unusable
input (unreadable file, invalid JSON, wrong shape), with a message on stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from dflash.errors import UsageError
from dflash.geometry import ChainGeometry, Rejection, TreeGeometry, validate_chain, validate_tree

EXIT_ACCEPTED, EXIT_REJECTED, EXIT_UNUSABLE = 0, 1, 2


class UnusableInput(UsageError):
    """The input could not be read as a parent array document."""


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "validate", help="validate a draft parent array; exit 0 accepted, 1 rejected, 2 unusable",
        description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("file", nargs="?", default="-",
                        help='JSON file with {"parents": [...], "n_actual": N} or a bare list; '
                             "'-' or nothing reads stdin")
    parser.add_argument("--tree", action="store_true",
                        help="use the tree policy (siblings allowed) instead of the chain policy")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(run=run)


def _not_json(name: str) -> object:
    raise ValueError(f"{name} is not a JSON value")


def read_document(source: str) -> tuple[object, object]:
    """``(parents, n_actual)`` from a file path or ``-`` (stdin)."""
    try:
        text = sys.stdin.read() if source == "-" else Path(source).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise UnusableInput(f"cannot read {source!r}: {err}") from None
    try:
        document = json.loads(text, parse_constant=_not_json)
    except json.JSONDecodeError as err:
        raise UnusableInput(f"{source!r} is not valid JSON: {err}") from None
    except ValueError as err:  # NaN / Infinity, which JSON does not have
        raise UnusableInput(f"{source!r} is not valid JSON: {err}") from None
    except RecursionError:
        raise UnusableInput(
            f"{source!r} nests its JSON deeper than this reader follows "
            f"({sys.getrecursionlimit()} levels); a parents list is flat"
        ) from None
    if isinstance(document, list):
        return document, None
    if isinstance(document, dict):
        unknown = sorted(set(document) - {"parents", "n_actual"})
        if "parents" not in document:
            raise UnusableInput(f"{source!r}: the JSON object needs a 'parents' key")
        if unknown:
            raise UnusableInput(f"{source!r}: unknown keys {unknown} "
                                "(expected 'parents' and optional 'n_actual')")
        return document["parents"], document.get("n_actual")
    raise UnusableInput(f"{source!r}: expected a JSON list or an object with 'parents' "
                        f"(got {type(document).__name__})")


def describe(verdict: ChainGeometry | TreeGeometry | Rejection) -> str:
    if isinstance(verdict, Rejection):
        slot = "" if verdict.slot is None else f" at slot {verdict.slot}"
        return f"rejected: {verdict.reason.value}{slot}\n  {verdict.message}"
    kind = "chain" if isinstance(verdict, ChainGeometry) else "tree"
    text = f"accepted: {kind} of {verdict.n_actual} slots, parents {list(verdict.parents)}"
    if isinstance(verdict, TreeGeometry):
        text += f"\n  depth {list(verdict.depth)}"
    return text


def run(args: argparse.Namespace) -> int:
    try:
        parents, n_actual = read_document(args.file)
    except UnusableInput as err:
        print(f"dflash validate: {err}", file=sys.stderr)
        return EXIT_UNUSABLE
    verdict = (validate_tree if args.tree else validate_chain)(parents, n_actual)
    print(verdict.to_json() if args.json else describe(verdict))
    return EXIT_REJECTED if isinstance(verdict, Rejection) else EXIT_ACCEPTED
