"""Every input maps to a geometry or a Rejection: nothing raises, bad values are named."""

from __future__ import annotations

import array
import decimal
import fractions
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest

from dflash.geometry import (
    MAX_SLOTS,
    ChainGeometry,
    Rejection,
    RejectReason,
    TreeGeometry,
    decode_int32_le,
    validate_chain,
    validate_tree,
)

torch = pytest.importorskip("torch")


class BadLen:
    def __len__(self) -> int:
        raise RuntimeError("no length")

    def __getitem__(self, i: int) -> int:
        return -1


class HugeLen(list):  # type: ignore[type-arg]  # a list lying about its length
    def __len__(self) -> int:
        return 10**30


class BadItem(list):  # type: ignore[type-arg]  # a list whose items cannot be read
    def __getitem__(self, i: object) -> Any:
        raise RuntimeError("boom")


class BadRepr:
    def __repr__(self) -> str:
        raise RuntimeError("no repr")


class Evil:
    """Every type check and attribute lookup raises."""

    @property  # type: ignore[misc]  # a raising __class__ is the point
    def __class__(self) -> type:
        raise RuntimeError("evil __class__")

    def __getattr__(self, name: str) -> Any:
        raise RuntimeError(f"evil {name}")

    def __eq__(self, other: object) -> bool:
        raise RuntimeError("evil __eq__")

    __hash__ = None  # type: ignore[assignment]  # unhashable, too


class ThreeSlots(Sequence):  # type: ignore[type-arg]  # a user Sequence without slicing
    def __len__(self) -> int:
        return 3

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            raise TypeError("no slices")
        return [-1, 0, 1][i]


def huge_int() -> int:
    return 10**5000  # more digits than int -> str allows by default


# (id, parents, n_actual, expected reason or "chain", expected slot)
CASES: list[tuple[str, Any, Any, str, int | None]] = [
    ("none", None, None, "null", None),
    ("int", 5, None, "null", None),
    ("float", 1.5, None, "null", None),
    ("str", "-1,0", None, "null", None),
    ("bytes", b"\xff\xff\xff\xff", None, "null", None),
    ("bytearray", bytearray(4), None, "null", None),
    ("memoryview", memoryview(b"1234"), None, "null", None),
    ("dict", {0: -1}, None, "null", None),
    ("set", {-1}, None, "null", None),
    ("iterator", iter([-1]), None, "null", None),
    ("bad_len", BadLen(), None, "null", None),
    ("huge_len", HugeLen([-1]), None, "null", None),
    ("bad_item", BadItem([-1, 0]), None, "null", None),
    ("empty", [], None, "null", None),
    ("n_zero", [-1], 0, "null", None),
    ("n_negative", [-1], -1, "null", None),
    ("n_bool", [-1], True, "null", None),
    ("n_float", [-1], 1.0, "null", None),
    ("n_str", [-1], "1", "null", None),
    ("n_numpy_bool", [-1], np.bool_(True), "null", None),
    ("n_torch_bool", [-1], torch.tensor(True), "null", None),
    ("n_list", [-1], [1], "null", None),
    ("n_bad_repr", [-1], BadRepr(), "null", None),
    ("n_huge_negative", [-1], -huge_int(), "null", None),
    ("n_numpy_int", [-1, 0], np.int64(2), "chain", None),
    ("n_torch_int", [-1, 0], torch.tensor(2), "chain", None),
    ("n_huge", [-1], huge_int(), "truncated", None),  # TRUNCATED precedes TOO_LARGE
    ("length_too_large", [-1, *range(MAX_SLOTS)], None, "too_large", None),
    ("n_too_large_short_input", [-1], MAX_SLOTS + 1, "truncated", None),
    ("n_too_large_long_input", [-1, *range(MAX_SLOTS)], MAX_SLOTS + 1, "too_large", None),
    ("n_at_limit", [-1, *range(MAX_SLOTS - 1)], MAX_SLOTS, "chain", None),
    ("bool_entry", [-1, True], None, "not_integer", 1),
    ("numpy_bool_entry", [-1, np.bool_(False)], None, "not_integer", 1),
    ("float_entry", [-1, 0.0], None, "not_integer", 1),
    ("str_entry", [-1, "0"], None, "not_integer", 1),
    ("none_entry", [-1, None], None, "not_integer", 1),
    ("nested_list", [[-1], [0]], None, "not_integer", 0),
    ("fraction_entry", [fractions.Fraction(-1)], None, "not_integer", 0),
    ("decimal_entry", [decimal.Decimal(-1)], None, "not_integer", 0),
    ("bad_repr_entry", [-1, BadRepr()], None, "not_integer", 1),
    ("tensor_1d_entry", [torch.tensor([-1])], None, "not_integer", 0),
    ("huge_entry", [-1, huge_int()], None, "out_of_range", 1),
    ("huge_negative_entry", [-1, -huge_int()], None, "out_of_range", 1),
    ("huge_root", [huge_int()], None, "malformed_root", 0),
    ("numpy_scalar_entries", [np.int8(-1), np.uint64(0)], None, "chain", None),
    ("torch_scalar_entry", [torch.tensor(-1)], None, "chain", None),
    ("user_sequence", ThreeSlots(), None, "chain", None),
    ("range", range(-1, 3), None, "chain", None),
    ("array_q", array.array("q", [-1, 0]), None, "chain", None),
    ("array_d", array.array("d", [-1.0]), None, "not_integer", 0),
    ("array_u", array.array("u", "ab"), None, "not_integer", 0),
    ("tail_ignored", [-1, 0, "junk", None], 2, "chain", None),
    ("evil_parents", Evil(), None, "null", None),
    ("evil_n_actual", [-1], Evil(), "null", None),
    ("evil_entry", [-1, Evil()], None, "not_integer", 1),
]

NUMPY_DTYPES = ["int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
                "float16", "float32", "float64", "complex64", "bool", "object", "U3", "S3",
                "datetime64[ns]", "timedelta64[s]", "i4,i4"]


@pytest.mark.parametrize(("parents", "n_actual", "expected", "slot"),
                         [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_hostile_input_gets_its_verdict(parents: Any, n_actual: Any, expected: str,
                                        slot: int | None) -> None:
    for validate, accepted in ((validate_chain, ChainGeometry), (validate_tree, TreeGeometry)):
        verdict = validate(parents, n_actual)
        if expected == "chain":
            assert isinstance(verdict, accepted)
            continue
        assert isinstance(verdict, Rejection), verdict
        assert (verdict.reason.value, verdict.slot) == (expected, slot)
        assert 0 < len(verdict.message) < 400
        verdict.to_json()  # always serialisable


def test_sibling_look_ahead_never_touches_a_foreign_entry() -> None:
    chain = validate_chain([-1, 0, 0, Evil()])  # the look-ahead passes over slot 3
    tree = validate_tree([-1, 0, 0, Evil()])
    assert isinstance(chain, Rejection) and (chain.reason, chain.slot) == (
        RejectReason.SKIPPED_PARENT, 2)
    assert isinstance(tree, Rejection) and (tree.reason, tree.slot) == (
        RejectReason.NOT_INTEGER, 3)
    assert "Evil" in tree.message


def test_messages_name_field_rule_and_value() -> None:
    verdict = validate_chain([-1, 0, 0, 2])
    assert isinstance(verdict, Rejection)
    assert verdict.message.startswith("'parents' slot 2 must be s-1=1 (got 0)")
    n_bad = validate_chain([-1], 2.5)
    assert isinstance(n_bad, Rejection) and "'n_actual'" in n_bad.message and "2.5" in n_bad.message
    big = validate_chain([-1, huge_int()])
    assert isinstance(big, Rejection) and "bits" in big.message


@pytest.mark.parametrize("dtype", NUMPY_DTYPES)
@pytest.mark.parametrize("shape", [(3,), (3, 2), (0,), ()], ids=str)
def test_numpy_arrays_of_any_dtype_and_shape(dtype: str, shape: tuple[int, ...]) -> None:
    values = np.zeros(shape, dtype=dtype)
    for validate in (validate_chain, validate_tree):
        verdict = validate(values)
        integer = np.dtype(dtype).kind in "iuO"  # object zeros are Python ints
        if shape == (3,) and integer:  # zeros: slot 0 must be -1
            assert isinstance(verdict, Rejection)
            assert verdict.reason is RejectReason.MALFORMED_ROOT
        elif shape in ((3,), (3, 2)):
            assert isinstance(verdict, Rejection) and verdict.reason is RejectReason.NOT_INTEGER
        else:  # empty or 0-d: nothing to validate
            assert isinstance(verdict, Rejection) and verdict.reason is RejectReason.NULL


def test_numpy_integer_arrays_validate_like_lists() -> None:
    for dtype in ("int8", "int16", "int32", "int64"):
        assert validate_chain(np.array([-1, 0, 1], dtype=dtype)) == validate_chain([-1, 0, 1])
        assert validate_tree(np.array([-1, 0, 0], dtype=dtype)) == validate_tree([-1, 0, 0])


@pytest.mark.parametrize("dtype", ["int8", "int16", "int32", "int64", "uint8", "float32",
                                   "float64", "bool", "complex64"])
def test_torch_tensors_of_any_dtype(dtype: str) -> None:
    tensor = torch.tensor([-1, 0, 1]).to(getattr(torch, dtype))
    verdict = validate_chain(tensor)
    if dtype.startswith("int"):
        assert isinstance(verdict, ChainGeometry)
    elif dtype == "uint8":  # -1 wraps to 255: a malformed root, not an accepted chain
        assert isinstance(verdict, Rejection) and verdict.reason is RejectReason.MALFORMED_ROOT
    else:
        assert isinstance(verdict, Rejection) and verdict.reason is RejectReason.NOT_INTEGER


def test_torch_unusual_tensors() -> None:
    grid = torch.arange(-1, 11).reshape(3, 4)
    assert isinstance(validate_chain(grid.t()[0]), Rejection)  # [-1, 3, 7]: strided view
    assert isinstance(validate_chain(torch.arange(-1, 3, dtype=torch.int64)[::1]), ChainGeometry)
    assert isinstance(validate_chain(torch.arange(-1, 3).float().requires_grad_()), Rejection)
    meta = validate_chain(torch.empty(3, dtype=torch.int64, device="meta"))
    assert isinstance(meta, Rejection) and meta.reason is RejectReason.NULL
    zero_d = validate_chain(torch.tensor(-1))
    assert isinstance(zero_d, Rejection) and zero_d.reason is RejectReason.NULL


def test_int32_buffer_decoder() -> None:
    assert decode_int32_le(b"\xff\xff\xff\xff\x00\x00\x00\x00") == (-1, 0)
    assert decode_int32_le(bytearray(b"\x01\x00\x00\x80")) == (-(2**31) + 1,)
    assert decode_int32_le(memoryview(array.array("i", [-1, 0]))) == (-1, 0)
    assert decode_int32_le(b"") == ()
    for bad in (b"abc", "abcd", None, 5, [1, 2, 3, 4], object()):
        verdict = decode_int32_le(bad)
        assert isinstance(verdict, Rejection) and verdict.reason is RejectReason.NULL
    # a buffer is never guessed at: it goes through the explicit decoder
    raw = validate_chain(b"\xff\xff\xff\xff")
    assert isinstance(raw, Rejection) and "decode_int32_le" in raw.message


def test_every_reject_reason_is_reached() -> None:
    """Every reason is produced by the validator itself on some input of this file (the
    hostile cases and the design's examples), counted from the verdicts, not the table."""
    probes: list[tuple[Any, Any]] = [(c[1], c[2]) for c in CASES]
    probes += [([-1, 0, 0, 2], None), ([-1, 0, 0], None), ([-1, 1], None), ([-1], 2)]
    reached: set[RejectReason] = set()
    for parents, n_actual in probes:
        verdict = validate_chain(parents, n_actual)
        if isinstance(verdict, Rejection):
            reached.add(verdict.reason)
    assert set(RejectReason) - reached == set()
