"""The z3 proof machinery (``specs/prove_geometry.py``): it proves, its formulas mean what
the Python specification means, and it fails with a concrete counterexample."""

from __future__ import annotations

import itertools
from typing import Any

import pytest

z3 = pytest.importorskip("z3")

from dflash.geometry import Rejection, RejectReason, rules  # noqa: E402  # after importorskip
from specs import prove_geometry  # noqa: E402  # after importorskip
from specs.geometry_spec import Policy, spec_verdict  # noqa: E402  # after importorskip

SLOT_REASONS = ("malformed_root", "out_of_range", "cyclic", "sibling", "skipped_parent")


@pytest.mark.parametrize("policy", ["chain", "tree"])
@pytest.mark.parametrize("trailing", [False, True])
def test_validator_proved_equal_to_spec_for_small_n(policy: Policy, trailing: bool) -> None:
    for n in range(1, 6):
        paths, counterexample = prove_geometry.prove(n, policy, trailing)
        assert counterexample is None
        assert paths >= 2  # at least one accepted and one rejected path


def _holds(spec: prove_geometry.GraphSpec, verdict: Any, values: tuple[int, ...]) -> bool:
    formula = z3.substitute(spec.holds(verdict),
                            *[(x, z3.IntVal(v)) for x, v in zip(spec.x, values, strict=True)])
    result = z3.simplify(formula)
    assert z3.is_true(result) or z3.is_false(result), result
    return bool(z3.is_true(result))


def _key(verdict: Any) -> tuple[Any, ...]:
    if isinstance(verdict, Rejection):
        return ("reject", verdict.reason.value, verdict.slot)
    return ("accept",)


@pytest.mark.parametrize("policy", ["chain", "tree"])
def test_z3_formulas_agree_with_the_python_spec(policy: Policy) -> None:
    """On every integer array of length 1..3 over [-2, 3], the z3 spec holds for exactly
    one verdict, the Python spec's (so the proof is about the spec of this repository)."""
    for n in range(1, 4):
        spec = prove_geometry.graph_spec(n, policy)
        candidates = ["accepted", *(Rejection(RejectReason(r), s, "candidate")
                                    for r in SLOT_REASONS for s in range(n))]
        for values in itertools.product(range(-2, 4), repeat=n):
            verdict = spec_verdict(list(values), None, policy)
            expected = verdict if verdict[0] == "reject" else ("accept",)
            holding = [_key(c) for c in candidates if _holds(spec, c, values)]
            assert holding == [expected], (values, holding, expected)


def test_proof_finds_a_planted_bug(monkeypatch: pytest.MonkeyPatch) -> None:
    def never_sibling(entries: object, n: int, s: int, e: int) -> rules.Violation:
        return (RejectReason.SKIPPED_PARENT, s, "planted bug")

    monkeypatch.setattr(rules, "_off_chain", never_sibling)
    _, counterexample = prove_geometry.prove(4, "chain", False)
    assert counterexample is not None
    assert "gives skipped_parent" in counterexample and "says sibling" in counterexample


def test_proof_finds_a_precedence_swap_with_a_concrete_input(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """CYCLIC before OUT_OF_RANGE: z3 reports a real input (e.g. ``[-1, 7]``), on which
    the validator run with plain ints really gives the wrong reason."""
    real = rules.first_violation

    def swapped(entries: Any, n: int, policy: rules.Policy) -> rules.Violation | None:
        for s in range(n):  # the planted order, for integer entries
            e = entries[s]
            if (s == 0 and e != -1) or (s > 0 and e == -1):
                break
            if e >= s:
                return (RejectReason.CYCLIC, s, "swapped")
            if e < -1 or e >= n:
                return (RejectReason.OUT_OF_RANGE, s, "swapped")
            if policy == "chain" and e < s - 1:
                break
        return real(entries, n, policy)

    monkeypatch.setattr("dflash.geometry.validate.first_violation", swapped)
    _, counterexample = prove_geometry.prove(2, "tree", False)
    assert counterexample is not None
    literal = counterexample.split("(", 1)[1].split("]", 1)[0] + "]"
    values = [int(v) for v in literal.strip("[]").split(",")]
    assert values[0] == -1 and values[1] >= 2  # a real out-of-range input, not placeholders
    assert "gives cyclic at slot 1" in counterexample
    assert "says out_of_range at slot 1" in counterexample


def test_symbolic_entries_refuse_arithmetic() -> None:
    explorer = prove_geometry.Explorer()
    value = prove_geometry.SymInt(explorer, z3.Int("x"))
    with pytest.raises(prove_geometry.SymbolicMisuse):
        _ = value + 1
    with pytest.raises(prove_geometry.SymbolicMisuse):
        bool(value)
