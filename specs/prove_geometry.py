"""Symbolic proof: the validators equal the specification for every integer parent array
of length n, for each n up to a bound (default 20), with entries unbounded integers.

Run ``python -m specs.prove_geometry [--max-n N]``; it prints the bound and the result.

How: the real ``validate_chain`` / ``validate_tree`` run on a list of :class:`SymInt`
values, ``int`` subclasses whose comparisons are z3 terms. Each comparison forks the run
(only where both outcomes are satisfiable with z3), so every feasible path through the
validator is executed once, ending in a concrete verdict under a path condition. For each
path, z3 shows that the path condition implies the specification's verdict, given by
:class:`GraphSpec`: the graph definitions of :mod:`specs.geometry_spec` (roots, parent
ranges, reachability from slot 0 by bounded ancestor chains, branching, forward edges) as
z3 formulas, not the validator's scanning rules. An accepting path must satisfy both of
the spec's definitions (graph acceptance and "every prefix well-formed"), a rejecting
path must fail graph acceptance and have its reason and slot as the first defect of the
least ill-formed prefix. A counterexample is printed as the concrete input (the model's
values), with the validator's and the specification's verdicts on it. Arithmetic or
truth-testing on a symbolic entry raises, so the validator cannot silently compute on a
placeholder value. Each n is checked twice: ``n_actual=None`` on n entries, and
``n_actual=n`` on n+1 entries (the extra entry is unconstrained and must not matter).

Scope, stated first: integer entries only (the input kinds, bools and non-integers are
covered by the exhaustive check, the property tests and the fuzzer), n_actual >= 1 given
or defaulted, n <= the bound. Absence of a counterexample beyond the bound is not claimed.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import z3

from dflash.geometry import ChainGeometry, Rejection, TreeGeometry, validate_chain, validate_tree
from specs.geometry_spec import Policy, accepted_as_graph, spec_verdict


class Explorer:
    """Depth-first enumeration of the feasible paths of a function over SymInts."""

    def __init__(self) -> None:
        self.solver = z3.Solver()
        self.pending: list[list[bool]] = []
        self.forced: list[bool] = []
        self.taken: list[bool] = []
        self.condition: list[Any] = []  # the current path condition, one term per decision

    def decide(self, cond: Any) -> bool:
        i = len(self.taken)
        if i < len(self.forced):
            choice = self.forced[i]
        else:
            can_true = self._feasible(cond)
            can_false = self._feasible(z3.Not(cond))
            if can_true and can_false:
                self.pending.append([*self.taken, False])
            choice = can_true
        self.taken.append(choice)
        self.condition.append(cond if choice else z3.Not(cond))
        self.solver.add(self.condition[-1])
        return choice

    def _feasible(self, cond: Any) -> bool:
        self.solver.push()
        self.solver.add(cond)
        result: bool = self.solver.check() == z3.sat
        self.solver.pop()
        return result

    def paths(self, run: Callable[[], Any]) -> Iterator[Any]:
        """Yields each path's result while its path condition is on the solver."""
        self.pending = [[]]
        while self.pending:
            self.forced, self.taken, self.condition = self.pending.pop(), [], []
            self.solver.push()
            try:
                yield run()
            finally:
                self.solver.pop()


class SymbolicMisuse(TypeError):
    """A symbolic entry was used other than by comparison."""


def _forbidden(name: str) -> Callable[..., Any]:
    def method(self: SymInt, *args: object) -> Any:
        raise SymbolicMisuse(f"validator applied {name} to a parent entry")
    return method


class SymInt(int):
    """An int whose comparisons are decided by the explorer (its int value is a dummy 0)."""

    explorer: Explorer
    term: Any

    def __new__(cls, explorer: Explorer, term: Any) -> SymInt:
        obj = super().__new__(cls, 0)
        obj.explorer, obj.term = explorer, term
        return obj

    def _cmp(self, other: object, op: Callable[[Any, Any], Any]) -> bool:
        if isinstance(other, SymInt):
            rhs = other.term
        elif isinstance(other, int) and not isinstance(other, bool):
            rhs = z3.IntVal(other)
        else:
            return NotImplemented  # type: ignore[no-any-return]  # the comparison protocol
        decided: bool = self.explorer.decide(op(self.term, rhs))
        return decided

    def __eq__(self, other: object) -> bool:
        return self._cmp(other, lambda a, b: a == b)

    def __ne__(self, other: object) -> bool:
        return self._cmp(other, lambda a, b: a != b)

    def __lt__(self, other: object) -> bool:
        return self._cmp(other, lambda a, b: a < b)

    def __le__(self, other: object) -> bool:
        return self._cmp(other, lambda a, b: a <= b)

    def __gt__(self, other: object) -> bool:
        return self._cmp(other, lambda a, b: a > b)

    def __ge__(self, other: object) -> bool:
        return self._cmp(other, lambda a, b: a >= b)

    __hash__ = int.__hash__
    __bool__ = _forbidden("bool()")
    for _name in ("add", "sub", "mul", "floordiv", "truediv", "mod", "pow", "and", "or", "xor",
                  "lshift", "rshift", "neg", "pos", "abs", "invert"):
        for _prefix in ("__", "__r"):
            if _prefix == "__r" and _name in ("neg", "pos", "abs", "invert"):
                continue
            locals()[f"{_prefix}{_name}__"] = _forbidden(f"{_prefix}{_name}__")
    del _name, _prefix


class GraphSpec:
    """The definitions of :mod:`specs.geometry_spec` as z3 formulas over integer entries.

    Sets of slots are finite and concrete, so membership is a disjunction of equalities
    and "for all slots" a conjunction; reachability from slot 0 inside a slot set ``S`` is
    the bounded ancestor-chain unrolling ``R_0(v) = (v = 0)``,
    ``R_{i+1}(v) = R_i(v) ∨ ∨_{u ∈ S, u ≠ v} (p[v] = u ∧ R_i(u))``, iterated ``|S| - 1``
    times (a simple path in ``S`` has at most that many edges).
    """

    def __init__(self, xs: Sequence[Any], n: int, policy: Policy) -> None:
        self.x, self.n, self.policy = list(xs[:n]), n, policy
        self.vertices = range(n)
        self._atoms: dict[tuple[int, int], Any] = {}
        self._defects = [self._prefix_defects(k) for k in range(n)]
        self.well_formed = [z3.Not(z3.Or(*[d for _, d in found])) for found in self._defects]
        self.graph = self.accepted_as_graph()

    def names(self, t: int, u: int) -> Any:
        """The atom ``p[t] = u`` (built once: z3py term construction is the cost here)."""
        atom = self._atoms.get((t, u))
        if atom is None:
            atom = self._atoms[(t, u)] = self.x[t] == u
        return atom

    def member(self, t: int, slots: Iterable[int]) -> Any:
        """The entry of slot ``t`` is in ``slots``."""
        return z3.Or(*[self.names(t, v) for v in slots])

    def roots_are_zero(self, slots: range) -> Any:
        """The roots of ``slots`` (entries -1) are exactly ``{0}``."""
        return z3.And(*[self.names(t, -1) if t == 0 else z3.Not(self.names(t, -1))
                        for t in slots])

    def in_range(self, slots: range) -> Any:
        """Every entry of ``slots`` is -1 or a vertex."""
        return z3.And(*[self.member(t, [-1, *self.vertices]) for t in slots])

    def all_reachable(self, slots: range) -> Any:
        """Every slot of ``slots`` is reachable from 0 along the edges induced on ``slots``."""
        reach = {v: z3.BoolVal(v == 0) for v in slots}
        for _ in range(len(slots) - 1):
            reach = {v: z3.Or(reach[v], *[z3.And(self.names(v, u), reach[u])
                                          for u in slots if u != v])
                     for v in slots}
        return z3.And(*reach.values())

    def branching(self, slots: range) -> Any:
        """Some slot of ``slots`` has two children inside ``slots``."""
        return z3.Or(*[z3.And(self.x[a] == self.x[b], self.member(a, slots))
                       for a in slots for b in slots if a < b])

    def has_child(self, slot: int) -> Any:
        return z3.Or(*[self.names(t, slot) for t in self.vertices])

    def _prefix_defects(self, k: int) -> list[tuple[str, Any]]:
        prefix = range(k + 1)
        found = [("malformed_root", z3.Not(self.roots_are_zero(prefix))),
                 ("out_of_range", z3.Not(self.in_range(prefix))),
                 ("cyclic", z3.Not(self.all_reachable(prefix)))]
        if self.policy == "chain":
            found.append(("branching", self.branching(prefix)))
        return found

    def accepted_as_graph(self) -> Any:
        """A spanning arborescence rooted at 0 with forward edges (chain: no branching)."""
        v = self.vertices
        forward = [z3.Implies(self.member(t, v), self.x[t] < t) for t in v]
        return z3.And(self.roots_are_zero(v), self.in_range(v), self.all_reachable(v), *forward,
                      *([z3.Not(self.branching(v))] if self.policy == "chain" else []))

    def reason_is(self, k: int, reason: str) -> Any:
        """Prefix ``P_k`` is the first ill-formed one and ``reason`` its first defect."""
        if reason in ("sibling", "skipped_parent"):
            child = self.has_child(k)
            return z3.And(self.reason_is(k, "branching"),
                          child if reason == "sibling" else z3.Not(child))
        before: list[Any] = []
        for name, defect in self._defects[k]:
            if name == reason:
                return z3.And(*self.well_formed[:k], *before, defect)
            before.append(z3.Not(defect))
        return z3.BoolVal(False)  # not a defect of this policy

    def obligations(self, verdict: Any) -> list[Any]:
        """The conjuncts of :meth:`holds`, each proved on its own (smaller queries)."""
        if not isinstance(verdict, Rejection):
            return [self.graph, *self.well_formed]
        if verdict.slot is None or verdict.slot >= self.n:
            return [z3.BoolVal(False)]
        k, reason = verdict.slot, verdict.reason.value
        # ¬graph follows from the prefix obligations by the lemma (definitions_agree), which
        # is proved once per length instead of on every path (z3 is much faster that way)
        obligations = list(self.well_formed[:k])
        if reason in ("sibling", "skipped_parent"):
            child = self.has_child(k)
            obligations.append(child if reason == "sibling" else z3.Not(child))
            reason = "branching"
        for name, defect in self._defects[k]:
            if name == reason:
                return [*obligations, defect]
            obligations.append(z3.Not(defect))
        return [z3.BoolVal(False)]  # not a defect of this policy

    def definitions_agree(self) -> Any:
        """The lemma: graph acceptance ⇔ every prefix well-formed (for every integer array)."""
        return self.graph == z3.And(*self.well_formed)

    def holds(self, verdict: Any) -> Any:
        """z3: the specification's verdict is ``verdict``; acceptance is required to hold
        by both definitions, rejection to fail the graph definition."""
        graph = self.graph
        if not isinstance(verdict, Rejection):
            return z3.And(graph, *self.well_formed)
        if verdict.slot is None or verdict.slot >= self.n:
            return z3.BoolVal(False)  # whole-input reasons cannot arise on n >= 1 integers
        return z3.And(z3.Not(graph), self.reason_is(verdict.slot, verdict.reason.value))


def refute(solver: Any, obligations: list[Any]) -> Any:
    """A model of the solver's assertions violating one obligation, or None when the
    assertions imply all of them."""
    for obligation in obligations:
        solver.push()
        solver.add(z3.Not(obligation))
        try:
            if solver.check() == z3.sat:
                return solver.model()
        finally:
            solver.pop()
    return None


@functools.lru_cache(maxsize=4)
def graph_spec(n: int, policy: Policy) -> GraphSpec:
    """The spec over the entries ``p0 … p{n-1}`` (shared by both n_actual forms)."""
    return GraphSpec([z3.Int(f"p{s}") for s in range(n)], n, policy)


def show_verdict(verdict: Any) -> str:
    if isinstance(verdict, Rejection):
        return f"{verdict.reason.value} at slot {verdict.slot}"
    return f"accepted {type(verdict).__name__}"


def show_spec(expected: tuple[Any, ...]) -> str:
    return f"{expected[1]} at slot {expected[2]}" if expected[0] == "reject" else "accepted"


def prove(n: int, policy: Policy, trailing: bool) -> tuple[int, str | None]:
    """(paths explored, counterexample or None) for length n under ``policy``.

    A counterexample is a concrete input: the model's values, on which the validator is
    run again (plain ints) and the Python specification is evaluated."""
    explorer = Explorer()
    terms = [z3.Int(f"p{s}") for s in range(n + trailing)]
    validate = validate_chain if policy == "chain" else validate_tree
    accepted_type = ChainGeometry if policy == "chain" else TreeGeometry
    n_actual = n if trailing else None
    spec = graph_spec(n, policy)

    def run() -> Any:
        return validate([SymInt(explorer, t) for t in terms], n_actual)

    paths = 0
    for verdict in explorer.paths(run):
        paths += 1
        if not isinstance(verdict, (Rejection, accepted_type)):
            return paths, f"unexpected verdict type {type(verdict).__name__}"
        model = refute(explorer.solver, spec.obligations(verdict))
        if model is not None:
            values = [model.eval(t, model_completion=True).as_long() for t in terms]
            concrete = validate(values, n_actual)
            expected = spec_verdict(values, n_actual, policy)
            graph = accepted_as_graph(values, n, policy)
            return paths, (f"{validate.__name__}({values}, n_actual={n_actual}) gives "
                           f"{show_verdict(concrete)}; the specification says "
                           f"{show_spec(expected)} (graph definition: "
                           f"{'accepted' if graph else 'rejected'})")
    if not trailing:  # the lemma does not depend on n_actual: proved once per length
        lemma = z3.Solver()
        lemma.add(z3.Not(spec.definitions_agree()))
        if lemma.check() == z3.sat:
            model = lemma.model()
            values = [model.eval(t, model_completion=True).as_long() for t in spec.x]
            return paths, (f"the graph and prefix definitions disagree on {values} "
                           f"({policy}): graph {accepted_as_graph(values, n, policy)}")
    return paths, None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m specs.prove_geometry",
                                     description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--max-n", type=int, default=20, help="largest length proved (default 20)")
    args = parser.parse_args(argv)
    print(f"bound: every integer parent array of length 1..{args.max_n} (entries unbounded "
          "integers), n_actual = length, and n_actual = length with one extra ignored entry")
    start = time.perf_counter()
    failures = 0
    for n in range(1, args.max_n + 1):
        line = []
        policies: tuple[Policy, ...] = ("chain", "tree")
        for policy in policies:
            for trailing in (False, True):
                paths, counterexample = prove(n, policy, trailing)
                if counterexample is not None:
                    failures += 1
                    print(f"COUNTEREXAMPLE: {counterexample}")
                line.append(f"{policy}{'+tail' if trailing else ''} {paths} paths")
        print(f"n={n:2d}: " + ", ".join(line) + f"  [{time.perf_counter() - start:.1f} s]")
    verdict = "PROVED" if failures == 0 else f"FAILED ({failures} counterexamples)"
    print(f"result: {verdict} for n <= {args.max_n} in {time.perf_counter() - start:.1f} s")
    return 0 if failures == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
