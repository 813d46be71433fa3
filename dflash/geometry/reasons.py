"""The rejection vocabulary: :class:`RejectReason`, :class:`Rejection`, :class:`GeometryError`.

A :class:`Rejection` is a plain frozen value: the first rule a draft geometry breaks
(in the precedence order of ``specs/geometry.md``), the first offending slot, and a
message naming the rule, the slot and the offending value.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass
from typing import Any

# GeometryError is the geometry layer's member of the dflash error hierarchy; it is defined
# in dflash.errors (which imports neither torch nor dflash) and re-exported here.
from dflash.errors import GeometryError

__all__ = ["GeometryError", "RejectReason", "Rejection"]


class RejectReason(str, enum.Enum):
    """Why a draft geometry was rejected, in precedence order (first match wins)."""

    NULL = "null"  # no usable parents / n_actual
    TOO_LARGE = "too_large"  # n_actual above MAX_SLOTS (checked before reading entries)
    TRUNCATED = "truncated"  # fewer than n_actual entries
    NOT_INTEGER = "not_integer"  # an entry is not an int (bool, float, str, ...)
    MALFORMED_ROOT = "malformed_root"  # slot 0 is not -1, or a later slot is -1
    OUT_OF_RANGE = "out_of_range"  # entry < -1 or >= n_actual
    CYCLIC = "cyclic"  # entry >= its own slot (self or forward parent)
    SKIPPED_PARENT = "skipped_parent"  # chain: a lone slot attached before its predecessor
    SIBLING = "sibling"  # chain: the draft branches and a later slot continues the branch

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True, slots=True)
class Rejection:
    """A rejected geometry: ``reason``, first offending ``slot`` (None for whole-input
    reasons NULL / TRUNCATED / TOO_LARGE) and a human ``message``."""

    reason: RejectReason
    slot: int | None
    message: str

    def __post_init__(self) -> None:
        if not isinstance(self.reason, RejectReason):
            raise TypeError(f"'reason' must be a RejectReason (got {self.reason!r})")
        if self.slot is not None and (type(self.slot) is not int or self.slot < 0):
            raise TypeError(f"'slot' must be None or an int >= 0 (got {self.slot!r})")
        if not isinstance(self.message, str):
            raise TypeError(f"'message' must be a str (got {type(self.message).__name__})")

    @property
    def accepted(self) -> bool:
        """Always False; lets callers branch on ``verdict.accepted`` for any verdict."""
        return False

    def to_dict(self) -> dict[str, Any]:
        return {
            "accepted": False,
            "reason": self.reason.value,
            "slot": self.slot,
            "message": self.message,
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, data: Any) -> Rejection:
        """Inverse of :meth:`to_dict`; raises ``ValueError`` naming the bad field."""
        if not isinstance(data, dict):
            raise ValueError(f"a rejection must be a JSON object (got {type(data).__name__})")
        if data.get("accepted") is not False:
            raise ValueError("'accepted' must be false for a rejection "
                             f"(got {data.get('accepted')!r})")
        try:
            reason = RejectReason(data.get("reason"))
        except ValueError:
            raise ValueError(f"'reason' must be one of {[r.value for r in RejectReason]} "
                             f"(got {data.get('reason')!r})") from None
        try:
            return cls(reason, data.get("slot"), data.get("message"))  # type: ignore[arg-type]  # checked in __post_init__
        except TypeError as err:
            raise ValueError(str(err)) from None

    @classmethod
    def from_json(cls, text: str | bytes) -> Rejection:
        return cls.from_dict(json.loads(text))
