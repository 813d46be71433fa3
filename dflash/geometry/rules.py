"""The scan: the first rule a parent array breaks, in the precedence order of the design.

This is the validator's core and the exact code that ``specs/prove_geometry.py`` runs
symbolically, so it only compares entries (``==``, ``<``, ``>=``) and never does
arithmetic on them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from dflash.geometry.inputs import show
from dflash.geometry.reasons import RejectReason

Policy = Literal["chain", "tree"]
Violation = tuple[RejectReason, int, str]  # (reason, slot, message)


def first_violation(entries: Sequence[object], n: int, policy: Policy) -> Violation | None:
    """Scan slots ``0 .. n-1`` of ``entries`` (``len(entries) >= n``); None if all pass."""
    for s in range(n):
        e = entries[s]
        if not isinstance(e, int) or isinstance(e, bool):
            return (RejectReason.NOT_INTEGER, s,
                    f"'parents' slot {s} must be an int (got {show(e)})")
        if s == 0 and e != -1:
            return (RejectReason.MALFORMED_ROOT, 0,
                    f"'parents' slot 0 is the root and must be -1 (got {show(e)})")
        if s > 0 and e == -1:
            return (RejectReason.MALFORMED_ROOT, s,
                    f"'parents' slot {s} must not be -1 (a second root; only slot 0 is the root)")
        if e < -1 or e >= n:
            return (RejectReason.OUT_OF_RANGE, s,
                    f"'parents' slot {s} must be in [-1, n_actual={n}) (got {show(e)})")
        if e >= s:
            return (RejectReason.CYCLIC, s,
                    f"'parents' slot {s} must name an earlier slot (< {s}) (got {show(e)})")
        if policy == "chain" and e < s - 1:
            return _off_chain(entries, n, s, e)
    return None


def _off_chain(entries: Sequence[object], n: int, s: int, e: int) -> Violation:
    """Slot ``s`` attaches to ``e < s-1``: SIBLING if a later slot continues from ``s``."""
    for t in range(s + 1, n):
        later = entries[t]
        if isinstance(later, int) and not isinstance(later, bool) and later == s:
            return (RejectReason.SIBLING, s,
                    f"'parents' slot {s} must be s-1={s - 1} (got {show(e)}): the draft branches "
                    f"at slot {show(e)} and slot {t} continues the branch (chain policy; "
                    "use validate_tree for trees)")
    return (RejectReason.SKIPPED_PARENT, s,
            f"'parents' slot {s} must be s-1={s - 1} (got {show(e)}): it skips its predecessor")
