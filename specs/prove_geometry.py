"""Symbolic proof: the validators equal the specification for every integer parent array
of length n, for each n up to a bound (default 20), with entries unbounded integers.

Run ``python -m specs.prove_geometry [--max-n N]``; it prints the bound and the result.

How: the real ``validate_chain`` / ``validate_tree`` run on a list of :class:`SymInt`
values, ``int`` subclasses whose comparisons are z3 terms. Each comparison forks the run
(only where both outcomes are satisfiable with z3), so every feasible path through the
validator is executed once, ending in a concrete verdict under a path condition. For each
path, z3 shows that the path condition implies the specification's verdict, written with
the same predicates as :mod:`specs.geometry_spec` (now over z3 integers). Arithmetic or
truth-testing on a symbolic entry raises, so the validator cannot silently compute on a
placeholder value. Each n is checked twice: ``n_actual=None`` on n entries, and
``n_actual=n`` on n+1 entries (the extra entry is unconstrained and must not matter).

Scope, stated first: integer entries only (the input kinds, bools and non-integers are
covered by the exhaustive check, the property tests and the fuzzer), n_actual >= 1 given
or defaulted, n <= the bound. Absence of a counterexample beyond the bound is not claimed.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import z3

from dflash.geometry import ChainGeometry, Rejection, TreeGeometry, validate_chain, validate_tree
from specs.geometry_spec import SLOT_RANKS, Logic, Policy, slot_predicates

Z3_LOGIC: Logic[Any] = Logic(
    and_=lambda *xs: z3.And(*xs) if xs else z3.BoolVal(True),
    or_=lambda *xs: z3.Or(*xs) if xs else z3.BoolVal(False),
    not_=z3.Not)


class Explorer:
    """Depth-first enumeration of the feasible paths of a function over SymInts."""

    def __init__(self) -> None:
        self.solver = z3.Solver()
        self.pending: list[list[bool]] = []
        self.forced: list[bool] = []
        self.taken: list[bool] = []

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
        self.solver.add(cond if choice else z3.Not(cond))
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
            self.forced, self.taken = self.pending.pop(), []
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


def spec_holds(xs: list[Any], n: int, policy: Policy, verdict: Any) -> Any:
    """z3: the specification's verdict on ``xs[:n]`` is ``verdict``."""
    ranked = sorted(
        ((s, SLOT_RANKS[reason]), reason, pred)
        for s in range(n)
        for reason, pred in slot_predicates(xs, n, s, policy, Z3_LOGIC, [True] * n).items())
    if not isinstance(verdict, Rejection):
        graph = ([xs[0] == -1] + [xs[s] == s - 1 for s in range(1, n)] if policy == "chain"
                 else [xs[0] == -1] + [z3.And(xs[s] >= 0, xs[s] < s) for s in range(1, n)])
        return z3.And(*[z3.Not(pred) for _, _, pred in ranked], *graph)
    if verdict.slot is None:
        return z3.BoolVal(False)  # whole-input reasons cannot arise on n >= 1 integer entries
    here = (verdict.slot, SLOT_RANKS[verdict.reason.value])
    matching = [pred for at, reason, pred in ranked
                if at == here and reason == verdict.reason.value]
    earlier = [z3.Not(pred) for at, _, pred in ranked if at < here]
    return z3.And(z3.Or(*matching) if matching else z3.BoolVal(False), *earlier)


def prove(n: int, policy: Policy, trailing: bool) -> tuple[int, str | None]:
    """(paths explored, counterexample or None) for length n under ``policy``."""
    explorer = Explorer()
    terms = [z3.Int(f"p{s}") for s in range(n + trailing)]
    validate = validate_chain if policy == "chain" else validate_tree
    accepted_type = ChainGeometry if policy == "chain" else TreeGeometry
    n_actual = n if trailing else None

    def run() -> Any:
        return validate([SymInt(explorer, t) for t in terms], n_actual)

    paths = 0
    for verdict in explorer.paths(run):
        paths += 1
        if not isinstance(verdict, (Rejection, accepted_type)):
            return paths, f"unexpected verdict type {type(verdict).__name__}"
        explorer.solver.push()
        explorer.solver.add(z3.Not(spec_holds(terms, n, policy, verdict)))
        if explorer.solver.check() == z3.sat:
            model = explorer.solver.model()
            values = [model.eval(t, model_completion=True).as_long() for t in terms]
            explorer.solver.pop()
            return paths, (f"{validate.__name__}({values}, n_actual={n_actual}) gave {verdict!r},"
                           " which the specification does not")
        explorer.solver.pop()
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
