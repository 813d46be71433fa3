"""Executable specification of draft-geometry validation, written as graph theory.

Nothing here scans entries the way the validator does. A parent array ``p`` of ``n``
slots is read as a directed graph, the **parent graph**: its vertices are the slots
``V = {0, …, n-1}``; slot ``t`` whose entry is an integer naming a vertex ``u`` gives the
edge ``u → t``. On it the spec uses only sets and graph notions:

* the **roots** of a slot set ``S``: the slots of ``S`` whose entry is ``-1``;
* the **edges** of ``S``: the parent edges with both ends in ``S`` (the induced subgraph);
* **reachability** from slot 0 along those edges;
* **children** of a slot, and **branching** (a slot with two children);
* **forward edges** (``u → t`` with ``u < t``: the numbering is a topological order).

**Acceptance** (:func:`accepted_as_graph`): the parent graph is an arborescence rooted at
slot 0 that spans ``V`` — every entry an integer, the roots exactly ``{0}``, every entry
``-1`` or a vertex, every slot reachable from 0 — whose edges all go forward; under the
chain policy it also has no branching (so it is the path ``0 → 1 → … → n-1``).

**Rejection** (:func:`first_failure`): the *prefixes* ``P_k = {0, …, k}`` are tested in
order of ``k``; a prefix is *well-formed* when it has none of the defects below (each a
property of the subgraph induced on ``P_k``). The reported slot is the least ``k`` whose
prefix is not well-formed, and the reason is the first defect of ``P_k`` in this order:

1. ``not_integer``    some slot of ``P_k`` has no integer entry (the graph is undefined there);
2. ``malformed_root`` the roots of ``P_k`` are not exactly ``{0}``;
3. ``out_of_range``   some entry of ``P_k`` is neither ``-1`` nor a vertex of ``V``
                      (an edge from nowhere);
4. ``cyclic``         some slot of ``P_k`` is not reachable from slot 0 inside ``P_k``
                      (it hangs from itself or from a later slot);
5. ``sibling`` / ``skipped_parent`` (chain policy) some slot of ``P_k`` has two children
   inside ``P_k``; it is ``sibling`` when slot ``k`` itself has a child in the whole graph
   (the draft continues along the branch), ``skipped_parent`` when ``k`` is a leaf.

The order is the order of well-definedness: a graph needs integer entries; reachability
from "the" root needs a single root; an edge must start at a vertex before one asks where
it leads; branching is a question about an arborescence.

The two definitions are independent; :func:`spec_verdict` checks on every call that
acceptance by the graph equals "every prefix well-formed" (the exhaustive check, the
property tests and the fuzzer all go through it), and ``specs/prove_geometry.py`` proves
the same for every integer array up to its bound. This module shares no code with
:mod:`dflash.geometry` (it does not import it).
"""

from __future__ import annotations

from collections.abc import Sequence, Set
from typing import Any, Literal

Policy = Literal["chain", "tree"]

#: Inputs with more slots than this are rejected as TOO_LARGE before any entry is read.
MAX_SLOTS = 1024

#: The prefix defects in precedence order (the last one splits into sibling / skipped_parent).
DEFECTS: tuple[str, ...] = ("not_integer", "malformed_root", "out_of_range", "cyclic",
                            "branching")

Edge = tuple[int, int]


class SpecInconsistency(AssertionError):
    """The specification's two definitions disagree on an input (a bug in this file)."""


def is_integer(value: object) -> bool:
    """The spec's notion of an integer entry: an ``int`` that is not a ``bool``."""
    return isinstance(value, int) and not isinstance(value, bool)


# -- graph notions on a slot set S of a draft p ---------------------------------------------


def roots(p: Sequence[object], slots: Set[int]) -> set[int]:
    """The slots of ``slots`` whose entry is the integer -1."""
    return {t for t in slots if is_integer(p[t]) and p[t] == -1}


def edges(p: Sequence[object], slots: Set[int]) -> set[Edge]:
    """The parent edges ``u → t`` of the subgraph induced on ``slots``."""
    return {(p[t], t) for t in slots if is_integer(p[t]) and p[t] in slots}  # type: ignore[misc]  # p[t] is an int here


def reachable(source: int, graph: Set[Edge]) -> set[int]:
    """The vertices reachable from ``source`` along ``graph`` (``source`` included)."""
    seen, frontier = {source}, {source}
    while frontier:
        frontier = {v for u, v in graph if u in frontier} - seen
        seen |= frontier
    return seen


def children(u: int, graph: Set[Edge]) -> set[int]:
    return {v for w, v in graph if w == u}


def branching(graph: Set[Edge]) -> bool:
    """Some vertex has two children."""
    return any(len(children(u, graph)) >= 2 for u, _ in graph)


def names_a_vertex_or_root(entry: object, vertices: Set[int]) -> bool:
    return is_integer(entry) and (entry == -1 or entry in vertices)


# -- the two definitions ----------------------------------------------------------------------


def accepted_as_graph(p: Sequence[object], n: int, policy: Policy) -> bool:
    """Acceptance: a spanning arborescence rooted at 0, topologically numbered; no
    branching under the chain policy."""
    vertices = set(range(n))
    if not all(is_integer(p[t]) for t in vertices):
        return False
    graph = edges(p, vertices)
    return (roots(p, vertices) == {0}
            and all(names_a_vertex_or_root(p[t], vertices) for t in vertices)
            and reachable(0, graph) == vertices
            and all(u < v for u, v in graph)
            and not (policy == "chain" and branching(graph)))


def prefix_defects(p: Sequence[object], n: int, k: int, policy: Policy) -> list[str]:
    """The defects of the prefix ``P_k = {0..k}`` of a draft of ``n`` slots, in
    precedence order (``[]``: the prefix is well-formed)."""
    prefix, vertices = set(range(k + 1)), set(range(n))
    if not all(is_integer(p[t]) for t in prefix):
        return ["not_integer"]  # the graph is not defined: no further question applies
    graph = edges(p, prefix)
    found = []
    if roots(p, prefix) != {0}:
        found.append("malformed_root")
    if not all(names_a_vertex_or_root(p[t], vertices) for t in prefix):
        found.append("out_of_range")
    if reachable(0, graph) != prefix:
        found.append("cyclic")
    if policy == "chain" and branching(graph):
        found.append("branching")
    return found


def has_child(p: Sequence[object], n: int, slot: int) -> bool:
    """Slot ``slot`` is the parent of some slot of the whole draft."""
    return any(is_integer(p[t]) and p[t] == slot for t in range(n))


def first_failure(p: Sequence[object], n: int, policy: Policy) -> tuple[int, str] | None:
    """``(slot, reason)``: the least prefix that is not well-formed and its first defect;
    None when every prefix is well-formed."""
    for k in range(n):
        found = prefix_defects(p, n, k, policy)
        if found:
            reason = found[0]
            if reason == "branching":
                reason = "sibling" if has_child(p, n, k) else "skipped_parent"
            return k, reason
    return None


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
    failure = first_failure(parents, n, policy)
    if (failure is None) != accepted_as_graph(parents, n, policy):
        raise SpecInconsistency(f"prefix and graph definitions disagree on {list(parents)!r} "
                                f"n={n} ({policy}): first failure {failure}")
    if failure is not None:
        slot, reason = failure
        return ("reject", reason, slot)
    return ("accept", tuple(parents[:n]))
