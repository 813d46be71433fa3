"""The nine reference cases of specs/geometry.md, with the execution sentinel."""

from __future__ import annotations

import pytest

from dflash.geometry import (
    ChainGeometry,
    GeometryError,
    Rejection,
    RejectReason,
    TreeGeometry,
    require_chain,
    run_if_root_inclusive_pure_chain,
    validate_chain,
)

# (case, parents, n_actual, expected reason or None for a chain, expected slot)
REFERENCE_CASES = [
    ("single_root", [-1], 1, None, None),
    ("pure_chain", [-1, 0, 1, 2, 3, 4], 6, None, None),
    ("malformed_root", [0, 0, 1], 3, RejectReason.MALFORMED_ROOT, 0),
    ("skipped_parent", [-1, 0, 0], 3, RejectReason.SKIPPED_PARENT, 2),
    ("sibling", [-1, 0, 0, 2], 4, RejectReason.SIBLING, 2),
    ("cycle_or_forward_parent", [-1, 2, 1], 3, RejectReason.CYCLIC, 1),
    ("out_of_range", [-1, 0, 7], 3, RejectReason.OUT_OF_RANGE, 2),
    ("truncated", [-1, 0], 3, RejectReason.TRUNCATED, None),
    ("null", None, 1, RejectReason.NULL, None),
]


class Sentinel:
    """Counts how often the guarded action ran."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self) -> None:
        self.calls += 1


@pytest.mark.parametrize(("case", "parents", "n_actual", "reason", "slot"), REFERENCE_CASES,
                         ids=[c[0] for c in REFERENCE_CASES])
def test_reference_case_verdict(case: str, parents: list[int] | None, n_actual: int,
                                reason: RejectReason | None, slot: int | None) -> None:
    verdict = validate_chain(parents, n_actual)
    if reason is None:
        assert isinstance(verdict, ChainGeometry)
        assert verdict.parents == tuple(parents or ())
        assert verdict.n_actual == n_actual
    else:
        assert isinstance(verdict, Rejection)
        assert (verdict.reason, verdict.slot) == (reason, slot)
        assert verdict.message  # names the rule
        if slot is not None:
            assert f"slot {slot}" in verdict.message


@pytest.mark.parametrize(("case", "parents", "n_actual", "reason", "slot"), REFERENCE_CASES,
                         ids=[c[0] for c in REFERENCE_CASES])
def test_execution_sentinel(case: str, parents: list[int] | None, n_actual: int,
                            reason: RejectReason | None, slot: int | None) -> None:
    sentinel = Sentinel()
    verdict = run_if_root_inclusive_pure_chain(parents, n_actual, sentinel)
    assert verdict == validate_chain(parents, n_actual)
    assert sentinel.calls == (1 if reason is None else 0)


@pytest.mark.parametrize(("case", "parents", "n_actual", "reason", "slot"), REFERENCE_CASES,
                         ids=[c[0] for c in REFERENCE_CASES])
def test_require_chain_raises_the_rejection(case: str, parents: list[int] | None, n_actual: int,
                                            reason: RejectReason | None,
                                            slot: int | None) -> None:
    if reason is None:
        assert require_chain(parents, n_actual) == validate_chain(parents, n_actual)
        return
    with pytest.raises(GeometryError) as info:
        require_chain(parents, n_actual)
    assert info.value.rejection == validate_chain(parents, n_actual)
    assert (info.value.reason, info.value.slot) == (reason, slot)


def test_sentinel_not_run_for_tree_geometry() -> None:
    # a valid tree is still not a pure chain: the chain-only action must not run
    sentinel = Sentinel()
    verdict = run_if_root_inclusive_pure_chain([-1, 0, 0, 1], 4, sentinel)
    assert isinstance(verdict, Rejection) and verdict.reason is RejectReason.SKIPPED_PARENT
    assert sentinel.calls == 0


def test_geometries_cannot_be_built_directly() -> None:
    with pytest.raises(TypeError, match="validate_chain"):
        ChainGeometry()
    with pytest.raises(TypeError, match="validate_tree"):
        TreeGeometry((-1,), 1)
    with pytest.raises(TypeError, match="may not subclass"):
        type("Forged", (ChainGeometry,), {})
