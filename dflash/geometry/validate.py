"""The validators: every input maps to a geometry or a :class:`Rejection`; none raises.

Precedence (first match wins; ``specs/geometry.md`` is the specification):

1. ``NULL``       parents is None / not a parent array, n_actual not an int >= 1
2. ``TRUNCATED``  fewer than n_actual entries
3. ``TOO_LARGE``  n_actual (or the length, when n_actual is None) above ``MAX_SLOTS``;
                  decided from the length alone, before any entry is read
4. per slot, in order: ``NOT_INTEGER``, ``MALFORMED_ROOT``, ``OUT_OF_RANGE``, ``CYCLIC``,
   then (chain policy only) ``SIBLING`` / ``SKIPPED_PARENT``  — see :mod:`.rules`.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from dflash.geometry.inputs import as_int, read_entries, read_length, show
from dflash.geometry.reasons import GeometryError, Rejection, RejectReason
from dflash.geometry.rules import first_violation
from dflash.geometry.values import MAX_SLOTS, ChainGeometry, TreeGeometry, make_chain, make_tree

Verdict = ChainGeometry | TreeGeometry | Rejection


def validate_chain(parents: object, n_actual: object = None) -> ChainGeometry | Rejection:
    """Validate a root-inclusive pure chain (``parents[s] == s-1``); never raises.

    ``n_actual`` defaults to the input length; entries past ``n_actual`` are ignored.
    """
    entries = _read(parents, n_actual)
    if isinstance(entries, Rejection):
        return entries
    violation = first_violation(entries, len(entries), "chain")
    if violation is not None:
        return Rejection(*violation)
    return make_chain(entries)  # type: ignore[arg-type]  # the scan proved every entry an int


def validate_tree(parents: object, n_actual: object = None) -> TreeGeometry | Rejection:
    """Validate a draft tree (opt-in policy: siblings allowed, all other rules as for
    chains); never raises."""
    entries = _read(parents, n_actual)
    if isinstance(entries, Rejection):
        return entries
    violation = first_violation(entries, len(entries), "tree")
    if violation is not None:
        return Rejection(*violation)
    return make_tree(entries)  # type: ignore[arg-type]  # the scan proved every entry an int


def require_chain(parents: object, n_actual: object = None) -> ChainGeometry:
    """:func:`validate_chain`, raising :class:`GeometryError` on rejection."""
    verdict = validate_chain(parents, n_actual)
    if isinstance(verdict, Rejection):
        raise GeometryError(verdict)
    return verdict


def require_tree(parents: object, n_actual: object = None) -> TreeGeometry:
    """:func:`validate_tree`, raising :class:`GeometryError` on rejection."""
    verdict = validate_tree(parents, n_actual)
    if isinstance(verdict, Rejection):
        raise GeometryError(verdict)
    return verdict


def run_if_root_inclusive_pure_chain(
    parents: object, n_actual: object, action: Callable[[], object]
) -> ChainGeometry | Rejection:
    """Call ``action()`` only when ``parents`` is a valid chain; return the verdict.

    On a rejected input ``action`` is never called (the execution sentinel)."""
    verdict = validate_chain(parents, n_actual)
    if isinstance(verdict, ChainGeometry):
        action()
    return verdict


def verdict_from_dict(data: Any) -> Verdict:
    """Inverse of ``verdict.to_dict()``. An accepted verdict is re-validated, so JSON can
    never forge a geometry; malformed data raises ``ValueError`` naming the field."""
    if not isinstance(data, dict):
        raise ValueError(f"a verdict must be a JSON object (got {type(data).__name__})")
    if data.get("accepted") is False:
        return Rejection.from_dict(data)
    if data.get("accepted") is not True:
        raise ValueError(f"'accepted' must be true or false (got {data.get('accepted')!r})")
    kind = data.get("kind")
    if kind not in ("chain", "tree"):
        raise ValueError(f"'kind' must be 'chain' or 'tree' (got {kind!r})")
    verdict = (validate_chain if kind == "chain" else validate_tree)(
        data.get("parents"), data.get("n_actual"))
    if isinstance(verdict, Rejection):
        raise ValueError(f"accepted {kind} does not validate: {verdict.message}")
    return verdict


def verdict_from_json(text: str | bytes) -> Verdict:
    return verdict_from_dict(json.loads(text))


def _read(parents: object, n_actual: object) -> list[object] | Rejection:
    length = read_length(parents)
    if isinstance(length, Rejection):
        return length
    if n_actual is None:
        n = length
        if n == 0:
            return Rejection(RejectReason.NULL, None,
                             "'parents' is empty (a geometry needs its root slot)")
    else:
        n_int = as_int(n_actual)
        if n_int is None or n_int < 1:
            return Rejection(RejectReason.NULL, None,
                             f"'n_actual' must be an int >= 1 (got {show(n_actual)})")
        n = n_int
    if length < n:
        return Rejection(RejectReason.TRUNCATED, None,
                         f"'parents' has {length} entries, fewer than n_actual={show(n)}")
    if n > MAX_SLOTS:
        what = "'n_actual'" if n_actual is not None else "'n_actual' (default: len(parents))"
        return Rejection(RejectReason.TOO_LARGE, None,
                         f"{what} must be at most MAX_SLOTS={MAX_SLOTS} (got {show(n)})")
    return read_entries(parents, n)


