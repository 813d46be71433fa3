"""Reading parent arrays of any supported kind into a list of entries, without raising.

Supported: list / tuple / other ``Sequence`` of ints, ``array.array``, numpy arrays and
torch tensors (duck-typed through ``dtype`` / ``tolist`` / ``detach`` / ``cpu``, any
device, any strides), plus little-endian int32 byte buffers through the explicit
:func:`decode_int32_le`. Nothing here imports torch or numpy.

Every entry that is an integer becomes a Python ``int``; every other entry becomes a
:class:`NonInteger` holding a description for the message. ``bool`` is not an integer.
"""

from __future__ import annotations

import array
import operator
import reprlib
import struct
from collections.abc import Sequence

from dflash.geometry.reasons import Rejection, RejectReason

_INTEGER_KINDS = frozenset("iu")  # numpy dtype kinds that hold integers
_INT32_LE = struct.Struct("<i")


class NonInteger:
    """Stands in for an entry that is not an integer, so the scan never touches a foreign
    object (whose ``__class__`` or ``__eq__`` could raise); keeps a description of it."""

    __slots__ = ("description",)

    def __init__(self, value: object) -> None:
        self.description = show(value)

    def __repr__(self) -> str:
        return self.description


def as_int(value: object) -> int | None:
    """``value`` as a Python int, or None when it is not an integer (bools are not).

    Never raises: an object whose attributes or type checks raise is not an integer."""
    try:
        return _as_int(value)
    except Exception:
        return None


def _as_int(value: object) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    dtype = getattr(value, "dtype", None)
    if dtype is None or getattr(value, "ndim", 0) != 0:
        return None
    kind = getattr(dtype, "kind", None)  # numpy scalars / 0-d arrays ("b" is bool)
    if kind is not None and kind not in _INTEGER_KINDS:
        return None
    if kind is None and "bool" in str(dtype):  # torch.bool
        return None
    if getattr(value, "is_floating_point", None) is not None:  # torch tensors
        try:
            if value.is_floating_point() or value.is_complex():  # type: ignore[attr-defined]  # duck-typed torch.Tensor
                return None
        except Exception:
            return None
    try:
        return operator.index(value)  # type: ignore[arg-type]  # duck-typed integer scalar
    except Exception:
        return None


def show(value: object, limit: int = 40) -> str:
    """A short, never-raising description of ``value`` for messages."""
    try:
        return _show(value, limit)
    except Exception:  # type() never consults the object, unlike isinstance / repr
        return f"<unprintable {type(value).__name__}>"


def _show(value: object, limit: int) -> str:
    if isinstance(value, NonInteger):
        return value.description
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 128:
        return f"an int of {value.bit_length()} bits"
    if isinstance(value, int) and not isinstance(value, bool):
        return int.__repr__(value)
    try:
        shorten = reprlib.Repr()
        shorten.maxstring = shorten.maxother = limit
        text = shorten.repr(value)
    except Exception:
        text = "<unprintable>"
    if len(text) > limit:
        text = text[: limit - 3] + "..."
    kind = type(value).__name__
    return f"{kind} {text}"


def read_length(parents: object) -> int | Rejection:
    """How many entries ``parents`` holds, or a NULL rejection when it is not a parent array."""
    try:
        return _read_length(parents)
    except Exception as err:  # a hostile object (e.g. a raising __class__): never propagate
        return _null(f"'parents' could not be inspected ({type(err).__name__})")


def _read_length(parents: object) -> int | Rejection:
    if parents is None:
        return _null("'parents' is None")
    if isinstance(parents, (str, bytes, bytearray, memoryview)):
        hint = "; decode int32 buffers with decode_int32_le" if not isinstance(parents, str) else ""
        return _null(f"'parents' must be a sequence of ints (got {type(parents).__name__}){hint}")
    if not _is_array_like(parents):
        return _null(f"'parents' must be a sequence of ints, an integer array or tensor "
                     f"(got {type(parents).__name__})")
    try:
        n = len(parents)  # type: ignore[arg-type]  # _is_array_like checked for __len__
    except Exception:
        return _null(f"'parents' has no length (got {show(parents)})")
    return n


def read_entries(parents: object, n: int) -> list[object] | Rejection:
    """The first ``n`` entries (``n`` <= length), ints canonicalised to ``int``."""
    try:
        raw = _first_entries(parents, n)
    except Exception as err:  # a hostile or unreadable container: never propagate
        return _null(f"'parents' could not be read ({type(err).__name__})")
    if len(raw) != n:
        return _null(f"'parents' yielded {len(raw)} entries where its length said {n}")
    if all(type(value) is int for value in raw):  # the common case: plain ints
        return raw
    out: list[object] = []
    for value in raw:
        as_integer = as_int(value)
        out.append(NonInteger(value) if as_integer is None else as_integer)
    return out


def decode_int32_le(data: object) -> tuple[int, ...] | Rejection:
    """Decode a little-endian int32 buffer (bytes, bytearray, memoryview) into a tuple.

    A buffer whose length is not a multiple of 4, or anything that is not a contiguous
    buffer, gives a NULL :class:`Rejection` (never an exception).
    """
    if isinstance(data, (str, int)) or data is None:
        return _null(f"int32 buffer must be bytes-like (got {type(data).__name__})")
    try:
        raw = memoryview(data).cast("B")  # type: ignore[arg-type]  # anything else raises TypeError
    except Exception:
        return _null("int32 buffer must be a contiguous bytes-like object "
                     f"(got {type(data).__name__})")
    if len(raw) % 4:
        return _null(f"int32 buffer length must be a multiple of 4 bytes (got {len(raw)})")
    return tuple(v for (v,) in _INT32_LE.iter_unpack(raw))


def _is_array_like(obj: object) -> bool:
    if isinstance(obj, (list, tuple, array.array, range, Sequence)):
        return True
    return hasattr(obj, "dtype") and hasattr(obj, "tolist") and hasattr(obj, "__len__")


def _first_entries(parents: object, n: int) -> list[object]:
    if isinstance(parents, (list, tuple)):
        return list(parents[:n])
    if isinstance(parents, array.array):
        return list(parents[:n].tolist())
    dtype = getattr(parents, "dtype", None)
    if dtype is not None and hasattr(parents, "tolist"):
        head = parents[:n]  # type: ignore[index]  # numpy / torch slicing
        kind = getattr(dtype, "kind", None)
        if kind is not None and kind not in _INTEGER_KINDS:
            # numpy non-integer dtypes: per-element scalars keep their dtype, so datetime64
            # or float entries are never mistaken for ints by .tolist().
            return list(head)
        for step in ("detach", "cpu"):  # torch: any device, any strides
            fn = getattr(head, step, None)
            if fn is not None:
                head = fn()
        listed = head.tolist()
        return list(listed) if isinstance(listed, list) else [listed]
    seq: Sequence[object] = parents  # type: ignore[assignment]  # _is_array_like: a Sequence
    return [seq[i] for i in range(n)]


def _null(message: str) -> Rejection:
    return Rejection(RejectReason.NULL, None, message)
