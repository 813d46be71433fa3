"""Validator ≡ specification on every small input (``specs/check_exhaustive.py``), and the
specification's two definitions (rule violations vs. graph acceptance) agree."""

from __future__ import annotations

import itertools

import pytest

from specs import check_exhaustive
from specs.geometry_spec import Policy, accepted_as_graph, violations


def test_validator_matches_spec_on_every_small_input() -> None:
    counts = check_exhaustive.run(workers=2)
    # 9^k arrays of each length k <= 6, each with n_actual in None, 0..k+1
    assert counts == {"chain": check_exhaustive.expected_count(),
                      "tree": check_exhaustive.expected_count()}
    assert check_exhaustive.expected_count() == 5_306_106


def test_a_mismatch_would_be_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    """The check can fail: a validator that accepts everything is caught."""
    from dflash.geometry import validate_tree

    monkeypatch.setitem(check_exhaustive.VALIDATORS, "chain", validate_tree)
    with pytest.raises(AssertionError, match="validate_tree"):
        check_exhaustive.check_chunk("chain", -1)


@pytest.mark.parametrize("policy", ["chain", "tree"])
def test_spec_definitions_agree(policy: Policy) -> None:
    """No violations ⇔ the parent graph is a path (chain) / topologically numbered
    arborescence (tree), for every array of length 1..5 over [-2, 5]."""
    accepted = 0
    for length in range(1, 6):
        for arr in itertools.product(range(-2, 6), repeat=length):
            by_rules = not violations(arr, length, policy)
            assert by_rules == accepted_as_graph(arr, length, policy), arr
            accepted += by_rules
    # chains: one per length; trees: (n-1)! topologically numbered recursive trees
    assert accepted == (5 if policy == "chain" else 1 + 1 + 2 + 6 + 24)
