"""The z3 proof machinery (``specs/prove_geometry.py``): it proves, and it can fail."""

from __future__ import annotations

import pytest

pytest.importorskip("z3")

from dflash.geometry import RejectReason, rules
from specs import prove_geometry


@pytest.mark.parametrize("policy", ["chain", "tree"])
@pytest.mark.parametrize("trailing", [False, True])
def test_validator_proved_equal_to_spec_for_small_n(policy: str, trailing: bool) -> None:
    for n in range(1, 6):
        paths, counterexample = prove_geometry.prove(n, policy, trailing)  # type: ignore[arg-type]
        assert counterexample is None
        assert paths >= 2  # at least one accepted and one rejected path


def test_proof_finds_a_planted_bug(monkeypatch: pytest.MonkeyPatch) -> None:
    def never_sibling(entries: object, n: int, s: int, e: int) -> rules.Violation:
        return (RejectReason.SKIPPED_PARENT, s, "planted bug")

    monkeypatch.setattr(rules, "_off_chain", never_sibling)
    _, counterexample = prove_geometry.prove(4, "chain", False)
    assert counterexample is not None and "SKIPPED_PARENT" in counterexample


def test_symbolic_entries_refuse_arithmetic() -> None:
    explorer = prove_geometry.Explorer()
    value = prove_geometry.SymInt(explorer, prove_geometry.z3.Int("x"))
    with pytest.raises(prove_geometry.SymbolicMisuse):
        _ = value + 1
    with pytest.raises(prove_geometry.SymbolicMisuse):
        bool(value)
