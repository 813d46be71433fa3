"""The validated geometry values: :class:`ChainGeometry` and :class:`TreeGeometry`.

Both are frozen, slotted and hashable, and only the validators build them: calling the
class raises ``TypeError`` and subclassing is refused, so holding one is proof that
``validate_chain`` / ``validate_tree`` accepted its parent array. Copies and pickles
re-run the validator on the way back in.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, NoReturn, final

#: The largest n_actual either validator accepts (larger inputs get TOO_LARGE). A tree's
#: ancestor mask is n_actual² booleans, so this keeps every derived value small.
MAX_SLOTS = 1024


class _Frozen:
    __slots__ = ()

    def __init__(self, *args: object, **kwargs: object) -> None:
        raise TypeError(
            f"{type(self).__name__} cannot be constructed directly; "
            "use validate_chain / validate_tree (or require_chain / require_tree)"
        )

    def __init_subclass__(cls, **kwargs: Any) -> None:
        if cls.__name__ not in ("ChainGeometry", "TreeGeometry") or cls.__module__ != __name__:
            raise TypeError(f"{cls.__name__} may not subclass a validated geometry")
        super().__init_subclass__(**kwargs)

    def __setattr__(self, name: str, value: object) -> NoReturn:
        raise AttributeError(f"{type(self).__name__} is immutable (cannot set {name!r})")

    def __delattr__(self, name: str) -> NoReturn:
        raise AttributeError(f"{type(self).__name__} is immutable (cannot delete {name!r})")

    def __copy__(self) -> _Frozen:
        return self

    def __deepcopy__(self, memo: object) -> _Frozen:
        return self


@final
class ChainGeometry(_Frozen):
    """A validated root-inclusive pure chain: ``parents == (-1, 0, 1, ..., n_actual-2)``."""

    __slots__ = ("n_actual", "parents")
    n_actual: int
    parents: tuple[int, ...]

    @property
    def accepted(self) -> bool:
        return True

    def __eq__(self, other: object) -> bool:
        return type(other) is ChainGeometry and other.parents == self.parents

    def __hash__(self) -> int:
        return hash(("chain", self.parents))

    def __repr__(self) -> str:
        return f"ChainGeometry(n_actual={self.n_actual}, parents={self.parents})"

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return (_rebuild, ("chain", self.parents))

    def to_dict(self) -> dict[str, Any]:
        return {"accepted": True, "kind": "chain", "n_actual": self.n_actual,
                "parents": list(self.parents)}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)


@final
class TreeGeometry(_Frozen):
    """A validated draft tree: slot 0 is the root, every other slot names an earlier slot.

    ``depth[s]`` is the number of edges from the root to ``s``; ``children[s]`` lists the
    slots whose parent is ``s`` in increasing order; ``ancestor_mask()[i][j]`` is True
    when ``j`` is ``i`` or an ancestor of ``i`` (token ``i`` may attend to slot ``j``).
    """

    __slots__ = ("_ancestor_bits", "children", "depth", "n_actual", "parents")
    n_actual: int
    parents: tuple[int, ...]
    depth: tuple[int, ...]
    children: tuple[tuple[int, ...], ...]
    _ancestor_bits: tuple[int, ...]  # bit j of entry i: j is i or an ancestor of i

    @property
    def accepted(self) -> bool:
        return True

    @property
    def is_chain(self) -> bool:
        """True when this tree is a pure chain (no slot has two children)."""
        return all(p == s - 1 for s, p in enumerate(self.parents))

    def ancestor_mask(self) -> tuple[tuple[bool, ...], ...]:
        """``[n_actual][n_actual]`` visibility mask, row i = slots token i may attend to."""
        n = self.n_actual
        return tuple(tuple(bool(bits >> j & 1) for j in range(n)) for bits in self._ancestor_bits)

    def is_ancestor(self, ancestor: int, slot: int) -> bool:
        """True when ``ancestor`` is ``slot`` itself or lies on its path to the root."""
        return bool(self._ancestor_bits[slot] >> ancestor & 1)

    def __eq__(self, other: object) -> bool:
        return type(other) is TreeGeometry and other.parents == self.parents

    def __hash__(self) -> int:
        return hash(("tree", self.parents))

    def __repr__(self) -> str:
        return f"TreeGeometry(n_actual={self.n_actual}, parents={self.parents})"

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return (_rebuild, ("tree", self.parents))

    def to_dict(self) -> dict[str, Any]:
        return {"accepted": True, "kind": "tree", "n_actual": self.n_actual,
                "parents": list(self.parents)}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)


def _seal(obj: _Frozen, **fields: object) -> None:
    for name, value in fields.items():
        object.__setattr__(obj, name, value)


def make_chain(parents: Sequence[int]) -> ChainGeometry:
    """Build a ChainGeometry from an already-validated chain (validators only)."""
    geom = object.__new__(ChainGeometry)
    _seal(geom, n_actual=len(parents), parents=tuple(int(p) for p in parents))
    return geom


def make_tree(parents: Sequence[int]) -> TreeGeometry:
    """Build a TreeGeometry from an already-validated tree (validators only).

    Validation guarantees ``parents[0] == -1`` and ``0 <= parents[s] < s`` for ``s >= 1``,
    so one forward pass computes depth, children and ancestor sets.
    """
    tparents = tuple(int(p) for p in parents)
    n = len(tparents)
    depth = [0] * n
    children: list[list[int]] = [[] for _ in range(n)]
    bits = [1] * n
    for s in range(1, n):
        p = tparents[s]
        depth[s] = depth[p] + 1
        children[p].append(s)
        bits[s] = bits[p] | (1 << s)
    geom = object.__new__(TreeGeometry)
    _seal(geom, n_actual=n, parents=tparents, depth=tuple(depth),
          children=tuple(tuple(c) for c in children), _ancestor_bits=tuple(bits))
    return geom


def _rebuild(kind: str, parents: tuple[int, ...]) -> ChainGeometry | TreeGeometry:
    """Unpickling entry point: re-validates, so a tampered pickle cannot forge a geometry."""
    from dflash.geometry.validate import require_chain, require_tree

    return require_chain(parents) if kind == "chain" else require_tree(parents)
