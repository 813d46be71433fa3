"""Executable specification of draft-geometry validation, written as logic, not as a scan.

A verdict is defined in two independent ways:

* **Rejections** — every rule of ``specs/geometry.md`` is a predicate on a slot. The set of
  *violations* is every ``(slot, rank, reason)`` whose predicate holds; the verdict is the
  least element of that set (slot first, then rank), or acceptance when it is empty.
  The predicates are built from a small :class:`Logic` (and / or / not) so the very same
  definitions are evaluated on Python ints (tests, fuzz oracle) and on z3 terms
  (``specs/prove_geometry.py``).
* **Acceptance** — as graph properties of the parent relation: a chain is the path
  ``0 ← 1 ← … ← n-1``; a tree is an arborescence rooted at slot 0 whose slot numbering is
  a topological order (every edge goes from a smaller to a larger slot).

The tests check that both definitions agree, and that the validator agrees with them.
This module deliberately shares no code with :mod:`dflash.geometry` (it does not import it).
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Literal, TypeVar

Policy = Literal["chain", "tree"]
B = TypeVar("B")  # a boolean: Python bool or a z3 BoolRef

#: Inputs with more slots than this are rejected as TOO_LARGE before any entry is read.
MAX_SLOTS = 1024

#: Per-slot rules in precedence order; SKIPPED_PARENT and SIBLING share the last rank
#: (they are mutually exclusive: a later slot continues from this slot, or none does).
SLOT_RANKS = {"not_integer": 0, "malformed_root": 1, "out_of_range": 2, "cyclic": 3,
              "skipped_parent": 4, "sibling": 4}


@dataclass(frozen=True)
class Logic(Generic[B]):
    """The connectives the predicates are written in."""

    and_: Callable[..., B]
    or_: Callable[..., B]
    not_: Callable[[B], B]


PYTHON_LOGIC: Logic[bool] = Logic(
    and_=lambda *xs: all(xs), or_=lambda *xs: any(xs), not_=operator.not_)


def is_integer(value: object) -> bool:
    """The spec's notion of an integer entry: an ``int`` that is not a ``bool``."""
    return isinstance(value, int) and not isinstance(value, bool)


def slot_predicates(p: Sequence[Any], n: int, s: int, policy: Policy, logic: Logic[Any],
                    integer_at: Sequence[bool]) -> dict[str, Any]:
    """The numeric rules for slot ``s`` (its entry ``p[s]`` is an integer), keyed by reason.

    ``p`` holds ints or z3 integer terms; ``integer_at[t]`` says whether entry ``t`` is an
    integer (always true for z3 terms), since only an integer can name a parent.
    """
    e = p[s]
    rules = {
        "malformed_root": logic.or_(logic.and_(s == 0, e != -1), logic.and_(s > 0, e == -1)),
        "out_of_range": logic.or_(e < -1, e >= n),
        "cyclic": e >= s,
    }
    if policy == "chain":
        continued = logic.or_(*[p[t] == s for t in range(s + 1, n) if integer_at[t]])
        rules["skipped_parent"] = logic.and_(e < s - 1, logic.not_(continued))
        rules["sibling"] = logic.and_(e < s - 1, continued)
    return rules


def violations(p: Sequence[object], n: int, policy: Policy) -> set[tuple[int, int, str]]:
    """Every ``(slot, rank, reason)`` broken by the first ``n`` entries of ``p``."""
    integer_at = [is_integer(p[s]) for s in range(n)]
    found = {(s, 0, "not_integer") for s in range(n) if not integer_at[s]}
    found |= {(s, SLOT_RANKS[reason], reason)
              for s in range(n) if integer_at[s]
              for reason, holds in slot_predicates(p, n, s, policy, PYTHON_LOGIC,
                                                   integer_at).items()
              if holds}
    return found


def accepted_as_graph(p: Sequence[int], n: int, policy: Policy) -> bool:
    """Acceptance as a graph property of the edges ``p[s] → s`` (entries all integers)."""
    nodes = set(range(n))
    roots = {s for s in nodes if p[s] == -1}
    edges = {(p[s], s) for s in nodes - {0}}
    if policy == "chain":
        return roots == {0} and edges == {(s - 1, s) for s in range(1, n)}
    if roots != {0} or any(u not in nodes for u, _ in edges):
        return False
    if any(u >= v for u, v in edges):  # the numbering must be a topological order
        return False
    reached, frontier = {0}, {0}  # an arborescence: every slot is reachable from the root
    while frontier:
        frontier = {v for u, v in edges if u in frontier} - reached
        reached |= frontier
    return reached == nodes


def spec_verdict(parents: object, n_actual: object, policy: Policy) -> tuple[Any, ...]:
    """The specified verdict for a plain list/tuple input (``parents`` may be None).

    Returns ``("accept", parents_tuple)`` or ``("reject", reason_value, slot)``.
    """
    if not isinstance(parents, (list, tuple)):
        return ("reject", "null", None)
    if n_actual is None:
        n_actual = len(parents)
    if not is_integer(n_actual) or n_actual < 1:  # type: ignore[operator]  # guarded by is_integer
        return ("reject", "null", None)
    n: int = n_actual  # type: ignore[assignment]  # is_integer checked above
    if len(parents) < n:
        return ("reject", "truncated", None)
    if n > MAX_SLOTS:
        return ("reject", "too_large", None)
    found = violations(parents, n, policy)
    accepted = accepted_as_graph(parents, n, policy) if not found else False
    if not found and not accepted:  # pragma: no cover - the two definitions disagree
        raise AssertionError(f"spec inconsistency on {parents!r} n={n}")
    if found:
        slot, _, reason = min(found)
        return ("reject", reason, slot)
    return ("accept", tuple(parents[:n]))

