"""Behaviour pinned for mutants of ``dflash/geometry`` that the other geometry tests let
through (``python -m mutation``); each test names the behaviour, not the mutant."""

from __future__ import annotations

import json

import pytest

from dflash.geometry import verdict_from_dict, verdict_from_json


@pytest.mark.parametrize(("text", "message"), [
    ("[1, 2]", "a verdict must be a JSON object (got list)"),
    ('"chain"', "a verdict must be a JSON object (got str)"),
    ('{"kind": "chain", "parents": [-1]}', "'accepted' must be true or false (got None)"),
    ('{"accepted": "yes", "kind": "chain", "parents": [-1]}',
     "'accepted' must be true or false (got 'yes')"),
    ('{"accepted": 1, "kind": "chain", "parents": [-1]}',
     "'accepted' must be true or false (got 1)"),
])
def test_malformed_verdict_json_is_refused_by_name(text: str, message: str) -> None:
    with pytest.raises(ValueError) as err:
        verdict_from_json(text)
    assert str(err.value) == message
    with pytest.raises(ValueError):
        verdict_from_dict(json.loads(text))


def test_too_large_message_says_whether_n_actual_was_given() -> None:
    from dflash.geometry import MAX_SLOTS, Rejection, validate_chain

    long = [-1, *range(MAX_SLOTS)]
    given = validate_chain(long, MAX_SLOTS + 1)
    defaulted = validate_chain(long)
    assert isinstance(given, Rejection) and isinstance(defaulted, Rejection)
    assert given.message == "'n_actual' must be at most MAX_SLOTS=1024 (got 1025)"
    assert defaulted.message == ("'n_actual' (default: len(parents)) must be at most "
                                 "MAX_SLOTS=1024 (got 1025)")


def test_messages_shorten_values_to_40_characters() -> None:
    from dflash.geometry import Rejection, validate_chain

    verdict = validate_chain([-1, "x" * 100])
    assert isinstance(verdict, Rejection)
    shown = "'" + "x" * 17 + "..." + "x" * 18 + "'"  # exactly 40 characters
    assert len(shown) == 40
    assert verdict.message == f"'parents' slot 1 must be an int (got str {shown})"


@pytest.mark.parametrize(("value", "shown"), [
    (2**127, str(2**127)),  # 128 bits: still printed in full
    (-(2**128) + 1, str(-(2**128) + 1)),  # 128 bits
    (2**128, "an int of 129 bits"),
    (-(2**200), "an int of 201 bits"),
])
def test_huge_ints_are_described_by_their_size_past_128_bits(value: int, shown: str) -> None:
    from dflash.geometry import Rejection, validate_chain

    verdict = validate_chain([-1, value])
    assert isinstance(verdict, Rejection)
    assert verdict.message == f"'parents' slot 1 must be in [-1, n_actual=2) (got {shown})"


class LyingLength(list):  # type: ignore[type-arg]  # a list claiming one entry more than it has
    def __len__(self) -> int:
        return super().__len__() + 1


def test_a_container_yielding_fewer_entries_than_its_length_is_null() -> None:
    from dflash.geometry import Rejection, RejectReason, validate_chain, validate_tree

    for validate in (validate_chain, validate_tree):
        verdict = validate(LyingLength([-1, 0]))
        assert isinstance(verdict, Rejection) and verdict.reason is RejectReason.NULL
        assert verdict.message == "'parents' yielded 2 entries where its length said 3"


@pytest.mark.parametrize(("data", "kind"), [(None, "NoneType"), ("abcd", "str"), (5, "int")])
def test_decoder_names_non_buffers(data: object, kind: str) -> None:
    from dflash.geometry import Rejection, decode_int32_le

    verdict = decode_int32_le(data)
    assert isinstance(verdict, Rejection)
    assert verdict.message == f"int32 buffer must be bytes-like (got {kind})"


def test_a_user_sequence_with_tolist_but_no_dtype_is_read_as_a_sequence() -> None:
    from collections.abc import Sequence
    from typing import Any

    from dflash.geometry import ChainGeometry, validate_chain

    class Listish(Sequence):  # type: ignore[type-arg]  # no slicing, a tolist that lies
        def __len__(self) -> int:
            return 3

        def __getitem__(self, i: Any) -> Any:
            if isinstance(i, slice):
                raise TypeError("no slices")
            return [-1, 0, 1][i]

        def tolist(self) -> list[int]:
            return [7, 7, 7]

    assert isinstance(validate_chain(Listish()), ChainGeometry)


def test_accepted_flags_equality_and_dicts_of_each_kind() -> None:
    from dflash.geometry import Rejection, validate_chain, validate_tree

    chain, tree, rejection = validate_chain([-1, 0]), validate_tree([-1, 0]), validate_chain([0])
    assert chain.accepted is True and tree.accepted is True
    assert isinstance(rejection, Rejection) and rejection.accepted is False
    assert chain != tree and tree != chain and chain == validate_chain((-1, 0))
    assert chain != validate_chain([-1]) and tree != validate_tree([-1])
    assert chain.to_dict() == {"accepted": True, "kind": "chain", "n_actual": 2,
                               "parents": [-1, 0]}
    assert tree.to_dict() == {"accepted": True, "kind": "tree", "n_actual": 2,
                              "parents": [-1, 0]}
    assert verdict_from_json(chain.to_json()) == chain
    assert verdict_from_json(tree.to_json()) == tree


def test_is_ancestor_agrees_with_the_mask_and_the_parent_walk() -> None:
    from dflash.geometry import TreeGeometry, validate_tree

    parents = [-1, 0, 0, 1, 3, 2]
    tree = validate_tree(parents)
    assert isinstance(tree, TreeGeometry)
    mask = tree.ancestor_mask()
    for s in range(len(parents)):
        line = {s}
        while parents[min(line)] != -1:
            line.add(parents[min(line)])
        for a in range(len(parents)):
            assert tree.is_ancestor(a, s) is (a in line) is mask[s][a], (a, s)


def test_json_text_is_canonical() -> None:
    from dflash.geometry import validate_chain, validate_tree

    assert validate_chain([-1, 0]).to_json() == (
        '{"accepted": true, "kind": "chain", "n_actual": 2, "parents": [-1, 0]}')
    assert validate_tree([-1, 0]).to_json() == (
        '{"accepted": true, "kind": "tree", "n_actual": 2, "parents": [-1, 0]}')
    assert validate_chain([0]).to_json() == (
        '{"accepted": false, "message": "\'parents\' slot 0 is the root and must be -1 '
        '(got 0)", "reason": "malformed_root", "slot": 0}')


def test_max_slots_is_the_specified_1024() -> None:
    from dflash.geometry import MAX_SLOTS
    from specs.geometry_spec import MAX_SLOTS as SPEC_MAX_SLOTS

    assert MAX_SLOTS == SPEC_MAX_SLOTS == 1024


def test_a_foreign_class_named_like_a_geometry_cannot_subclass_it() -> None:
    from dflash.geometry import values

    with pytest.raises(TypeError, match="may not subclass"):
        type("ChainGeometry", (values.ChainGeometry,), {"__module__": __name__})
    with pytest.raises(TypeError, match="may not subclass"):
        type("Other", (values.TreeGeometry,), {"__module__": values.__name__})


def test_reason_str_and_rejection_field_checks() -> None:
    from dflash.geometry import Rejection, RejectReason

    assert str(RejectReason.SIBLING) == "sibling" and f"{RejectReason.NULL}" == "null"
    assert Rejection(RejectReason.NULL, 0, "m").slot == 0
    assert Rejection(RejectReason.NULL, None, "m").slot is None
    with pytest.raises(TypeError, match="'reason' must be a RejectReason"):
        Rejection("sibling", 1, "m")  # type: ignore[arg-type]  # wrong type on purpose
    for slot in (-1, True, 1.0):
        with pytest.raises(TypeError, match="'slot' must be None or an int >= 0"):
            Rejection(RejectReason.SIBLING, slot, "m")  # type: ignore[arg-type]  # on purpose
    with pytest.raises(TypeError, match="'message' must be a str"):
        Rejection(RejectReason.NULL, None, 5)  # type: ignore[arg-type]  # on purpose


@pytest.mark.parametrize(("data", "message"), [
    ([1], "a rejection must be a JSON object (got list)"),
    ({"reason": "null", "slot": None, "message": "m"},
     "'accepted' must be false for a rejection (got None)"),
    ({"accepted": 0, "reason": "null", "slot": None, "message": "m"},
     "'accepted' must be false for a rejection (got 0)"),
    ({"accepted": False, "reason": "nope", "slot": None, "message": "m"},
     "'reason' must be one of ['null', 'too_large', 'truncated', 'not_integer', "
     "'malformed_root', 'out_of_range', 'cyclic', 'skipped_parent', 'sibling'] (got 'nope')"),
    ({"accepted": False, "reason": "null", "slot": -2, "message": "m"},
     "'slot' must be None or an int >= 0 (got -2)"),
])
def test_rejection_from_dict_names_the_bad_field(data: object, message: str) -> None:
    from dflash.geometry import Rejection

    with pytest.raises(ValueError) as err:
        Rejection.from_dict(data)
    assert str(err.value) == message
    good = {"accepted": False, "reason": "cyclic", "slot": 1, "message": "m"}
    assert Rejection.from_dict(good).to_dict() == good
    assert Rejection.from_json(Rejection.from_dict(good).to_json()) == Rejection.from_dict(good)


def test_values_whose_short_repr_fails_or_runs_long() -> None:
    from dflash.geometry import Rejection, validate_chain

    def boom(self: object) -> object:
        raise RuntimeError("no iteration")

    unlistable = type("list", (list,), {"__iter__": boom})([1])  # reprlib's list path raises
    verdict = validate_chain([-1, unlistable])
    assert isinstance(verdict, Rejection)
    assert verdict.message == "'parents' slot 1 must be an int (got list <unprintable>)"
    long = validate_chain([-1, ["a" * 30] * 3])  # each item shortened, the whole still long
    assert isinstance(long, Rejection)
    shown = "['" + "a" * 30 + "', 'a..."
    assert len(shown) == 40
    assert long.message == f"'parents' slot 1 must be an int (got list {shown})"


class DuckScalar:
    """A 0-d integer scalar known only by ``dtype`` and ``__index__`` (no ``ndim``)."""

    def __init__(self, value: int, floating: bool = False) -> None:
        import numpy as np

        self.dtype = np.dtype("int64") if not floating else "torch.float32"
        self.value, self.floating = value, floating

    def __index__(self) -> int:
        return self.value

    def is_floating_point(self) -> bool:
        return self.floating

    def is_complex(self) -> bool:
        return False


def test_duck_typed_scalars() -> None:
    from dflash.geometry import ChainGeometry, Rejection, RejectReason, validate_chain

    assert isinstance(validate_chain([-1, DuckScalar(0)]), ChainGeometry)  # no ndim: a scalar
    floating = validate_chain([-1, DuckScalar(0, floating=True)])  # says it is floating point
    assert isinstance(floating, Rejection) and floating.reason is RejectReason.NOT_INTEGER


def test_rejection_is_frozen_and_slotted() -> None:
    import dataclasses

    from dflash.geometry import Rejection, RejectReason

    rejection = Rejection(RejectReason.NULL, None, "m")
    with pytest.raises(dataclasses.FrozenInstanceError):
        rejection.slot = 3  # type: ignore[misc]  # mutation attempt on purpose
    assert not hasattr(rejection, "__dict__") and Rejection.__slots__ == ("reason", "slot",
                                                                          "message")
    assert hash(rejection) == hash(Rejection(RejectReason.NULL, None, "m"))
