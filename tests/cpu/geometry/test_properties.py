"""Hypothesis properties of the validators against the specification."""

from __future__ import annotations

import array
import copy
import json
import pickle
import struct
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dflash.geometry import (
    ChainGeometry,
    Rejection,
    TreeGeometry,
    decode_int32_le,
    validate_chain,
    validate_tree,
    verdict_from_json,
)
from specs.geometry_spec import Policy, spec_verdict

torch = pytest.importorskip("torch")

SETTINGS = settings(max_examples=150, deadline=None)


def key(verdict: Any) -> tuple[Any, ...]:
    if isinstance(verdict, Rejection):
        return ("reject", verdict.reason.value, verdict.slot)
    return ("accept", verdict.parents)


@st.composite
def trees(draw: st.DrawFn, max_n: int = 40) -> list[int]:
    """A topologically numbered tree: slot s >= 1 names any earlier slot."""
    n = draw(st.integers(1, max_n))
    return [-1] + [draw(st.integers(0, s - 1)) for s in range(1, n)]


chains = st.integers(1, 64).map(lambda n: [-1, *range(n - 1)])
entries = st.one_of(st.integers(-4, 70), st.integers(),
                    st.sampled_from([True, False, 1.0, None, "1"]))


@SETTINGS
@given(chains)
def test_every_valid_chain_is_accepted(parents: list[int]) -> None:
    chain = validate_chain(parents)
    tree = validate_tree(parents)
    assert isinstance(chain, ChainGeometry) and chain.parents == tuple(parents)
    assert isinstance(tree, TreeGeometry) and tree.is_chain
    assert tree.depth == tuple(range(len(parents)))


@SETTINGS
@given(trees())
def test_every_valid_tree_is_accepted_with_its_structure(parents: list[int]) -> None:
    tree = validate_tree(parents)
    assert isinstance(tree, TreeGeometry) and tree.parents == tuple(parents)
    n = len(parents)
    for s in range(n):  # brute force: walk to the root
        path = [s]
        while parents[path[-1]] != -1:
            path.append(parents[path[-1]])
        assert tree.depth[s] == len(path) - 1
        assert tree.ancestor_mask()[s] == tuple(j in path for j in range(n))
        assert tree.children[s] == tuple(t for t in range(n) if parents[t] == s)
    is_chain = parents == [-1, *range(n - 1)]
    assert isinstance(validate_chain(parents), ChainGeometry) == is_chain


@SETTINGS
@given(chains, st.data())
def test_every_single_entry_mutation_of_a_chain_is_rejected_as_specified(
        parents: list[int], data: st.DataObject) -> None:
    slot = data.draw(st.integers(0, len(parents) - 1))
    value = data.draw(entries.filter(lambda v: not (type(v) is int and v == parents[slot])))
    mutated: list[object] = list(parents)
    mutated[slot] = value
    validators: tuple[tuple[Policy, Callable[[object], object]], ...] = (
        ("chain", validate_chain), ("tree", validate_tree)
    )
    for policy, validate in validators:
        verdict = validate(mutated)
        assert key(verdict) == spec_verdict(mutated, None, policy)
        if policy == "chain":
            assert isinstance(verdict, Rejection) and verdict.slot == slot


@SETTINGS
@given(st.lists(entries, max_size=12), st.one_of(st.none(), st.integers(-2, 14)))
def test_validators_match_spec_on_arbitrary_lists(parents: list[object], n: int | None) -> None:
    assert key(validate_chain(parents, n)) == spec_verdict(parents, n, "chain")
    assert key(validate_tree(parents, n)) == spec_verdict(parents, n, "tree")


@SETTINGS
@given(st.one_of(trees(12), st.lists(st.integers(-3, 14), max_size=12)),
       st.one_of(st.none(), st.integers(0, 14)))
def test_verdicts_round_trip_through_json(parents: list[int], n: int | None) -> None:
    for validate in (validate_chain, validate_tree):
        verdict = validate(parents, n)
        text = verdict.to_json()
        back = verdict_from_json(text)
        assert back == verdict and type(back) is type(verdict)
        assert json.loads(text) == verdict.to_dict()


def containers(parents: list[int]) -> dict[str, object]:
    wide = np.zeros(2 * len(parents), dtype=np.int64)
    wide[::2] = parents
    grid = torch.zeros((len(parents), 3), dtype=torch.int32)
    grid[:, 1] = torch.tensor(parents, dtype=torch.int32)
    return {
        "list": parents,
        "tuple": tuple(parents),
        "array('i')": array.array("i", parents),
        "numpy int32": np.array(parents, dtype=np.int32),
        "numpy int64 strided": wide[::2],
        "torch int64": torch.tensor(parents, dtype=torch.int64),
        "torch int32 non-contiguous": grid[:, 1],
        "int32 buffer": decode_int32_le(struct.pack(f"<{len(parents)}i", *parents)),
    }


@SETTINGS
@given(st.one_of(trees(16), st.lists(st.integers(-3, 20), min_size=1, max_size=16)),
       st.one_of(st.none(), st.integers(0, 18)))
def test_equal_verdicts_across_input_kinds(parents: list[int], n: int | None) -> None:
    inputs = containers(parents)
    assert inputs["torch int32 non-contiguous"].stride() == (3,)  # type: ignore[attr-defined]
    for validate in (validate_chain, validate_tree):
        expected = validate(parents, n)
        for name, value in inputs.items():
            assert validate(value, n) == expected, name


@SETTINGS
@given(st.one_of(chains, trees()))
def test_geometries_are_immutable_and_hashable(parents: list[int]) -> None:
    for geometry in (validate_chain(parents), validate_tree(parents)):
        if isinstance(geometry, Rejection):
            continue
        for name in ("parents", "n_actual", "depth", "children", "_ancestor_bits"):
            with pytest.raises(AttributeError):
                setattr(geometry, name, None)
        with pytest.raises(AttributeError):
            del geometry.parents
        with pytest.raises(AttributeError):
            geometry.extra = 1
        validate = validate_chain if type(geometry) is ChainGeometry else validate_tree
        again = validate(list(parents))
        assert again == geometry and hash(again) == hash(geometry)
        assert copy.copy(geometry) is geometry and copy.deepcopy(geometry) is geometry
        assert pickle.loads(pickle.dumps(geometry)) == geometry


def test_pickle_cannot_forge_a_geometry() -> None:
    blob = pickle.dumps(validate_chain([-1, 0, 1]))
    forged = blob.replace(b"K\x00K\x01\x87", b"K\x00K\x00\x87")  # (-1, 0, 1) -> (-1, 0, 0)
    assert forged != blob
    with pytest.raises(ValueError, match="skipped_parent"):
        pickle.loads(forged)


def test_json_cannot_forge_a_geometry() -> None:
    with pytest.raises(ValueError, match="does not validate"):
        verdict_from_json('{"accepted": true, "kind": "chain", "parents": [-1, 0, 0]}')
    with pytest.raises(ValueError, match="'reason'"):
        verdict_from_json('{"accepted": false, "reason": "nope", "slot": 1, "message": "m"}')
    with pytest.raises(ValueError, match="'kind'"):
        verdict_from_json('{"accepted": true, "kind": "graph", "parents": [-1]}')
    with pytest.raises(ValueError, match="'slot'"):
        verdict_from_json('{"accepted": false, "reason": "null", "slot": true, "message": "m"}')
