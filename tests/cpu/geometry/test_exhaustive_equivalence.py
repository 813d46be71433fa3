"""Validator ≡ specification on every small input (``specs/check_exhaustive.py``), and the
specification's two definitions (least ill-formed prefix vs. graph acceptance) agree."""

from __future__ import annotations

import itertools

import pytest

from specs import check_exhaustive
from specs.geometry_spec import Policy, SpecInconsistency, accepted_as_graph, first_failure


def test_validator_matches_spec_on_every_small_input() -> None:
    counts = check_exhaustive.run(workers=2)
    # 9^k arrays of each length k <= 6, each with n_actual in None, 0..k+1; accepted: one
    # chain per length, (k-1)! trees of k slots
    assert counts == {"chain": (5_306_106, 6), "tree": (5_306_106, 154)}
    assert check_exhaustive.expected_count() == 5_306_106


def test_validator_matches_spec_small_bound() -> None:
    """The same check at length <= 4, in-process (seconds; the mutation runs use it)."""
    counts = check_exhaustive.run(workers=1, max_len=4)
    assert counts == {"chain": (check_exhaustive.expected_count(4), 4),
                      "tree": (check_exhaustive.expected_count(4), 1 + 1 + 2 + 6)}


def test_a_mismatch_would_be_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    """The check can fail: a validator that accepts every tree as a chain is caught."""
    from dflash.geometry import validate_tree

    monkeypatch.setitem(check_exhaustive.VALIDATORS, "chain", validate_tree)
    with pytest.raises(AssertionError, match="validate_tree"):
        check_exhaustive.check_chunk("chain", -1, 3)


def test_a_precedence_swap_would_be_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    """CYCLIC checked before OUT_OF_RANGE in the validator is caught by the check, with
    the spec unchanged (it has no precedence table to swap alongside)."""
    from dflash.geometry import Rejection, RejectReason, rules

    real = rules.first_violation

    def swapped(entries: list[object], n: int, policy: rules.Policy) -> rules.Violation | None:
        found = real(entries, n, policy)
        if found is not None and found[0] is RejectReason.OUT_OF_RANGE:
            e = entries[found[1]]
            if isinstance(e, int) and e >= found[1]:
                return (RejectReason.CYCLIC, found[1], "swapped")
        return found

    monkeypatch.setattr("dflash.geometry.validate.first_violation", swapped)
    planted = check_exhaustive.VALIDATORS["chain"]([-1, 5])
    assert isinstance(planted, Rejection) and planted.reason is RejectReason.CYCLIC
    with pytest.raises(AssertionError, match=r"\[-1, [2-6]\].*cyclic.*out_of_range"):
        check_exhaustive.check_chunk("chain", -1, 2)


@pytest.mark.parametrize("policy", ["chain", "tree"])
def test_spec_definitions_agree(policy: Policy) -> None:
    """No ill-formed prefix ⇔ the parent graph is a topologically numbered spanning
    arborescence rooted at 0 (chain: without branching), for every array of length 1..5
    over [-2, 5]; and an accepted chain is exactly ``[-1, 0, …, n-2]``."""
    accepted = 0
    for length in range(1, 6):
        for arr in itertools.product(range(-2, 6), repeat=length):
            by_prefix = first_failure(arr, length, policy) is None
            assert by_prefix == accepted_as_graph(arr, length, policy), arr
            if policy == "chain":
                assert by_prefix == (arr == (-1, *range(length - 1))), arr
            accepted += by_prefix
    # chains: one per length; trees: (n-1)! topologically numbered recursive trees
    assert accepted == (5 if policy == "chain" else 1 + 1 + 2 + 6 + 24)


def test_spec_reports_its_own_inconsistency(monkeypatch: pytest.MonkeyPatch) -> None:
    """If the graph definition drifted from the prefix definition, every caller of
    spec_verdict (exhaustive check, property tests, fuzzer) would stop with an error."""
    from specs import geometry_spec

    monkeypatch.setattr(geometry_spec, "accepted_as_graph", lambda p, n, policy: False)
    with pytest.raises(SpecInconsistency, match=r"\[-1, 0\]"):
        geometry_spec.spec_verdict([-1, 0], None, "chain")
