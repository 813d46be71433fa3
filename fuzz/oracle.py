"""The fuzz oracle: bytes → int32 buffer → both validators, checked against the spec.

Input layout (every byte string is a valid input)::

    byte 0   container: bits 0-2 pick list / tuple / array('i') / numpy int32 / numpy
             int64 / numpy int32 non-contiguous / "tagged" list (the int32 extremes
             stand for None, True, 1.0, "0") / numpy float64;
             bit 3 set: compact entries (one signed byte each, widened to int32 first)
    byte 1   n_actual: 0xFF → None, 0xFE → MAX_SLOTS + 1, 0xFD → -1, 0xFC → MAX_SLOTS + 1
             with the entries padded by zeros to MAX_SLOTS + 1 (so TOO_LARGE is reachable
             past TRUNCATED), else the byte value
    rest     the parent array as little-endian int32 words (or int8 when compact),
             always decoded through ``decode_int32_le``

:func:`check_one` returns the verdict's name (``"chain"``, ``"tree"`` or a reject reason)
for both policies and raises :class:`OracleMismatch` when the validator and the
specification disagree or a validator invariant fails.
"""

from __future__ import annotations

import array
import functools
import json
import struct
import zlib
from typing import Any

from dflash.geometry import (
    MAX_SLOTS,
    ChainGeometry,
    GeometryError,
    Rejection,
    RejectReason,
    TreeGeometry,
    decode_int32_le,
    require_chain,
    require_tree,
    run_if_root_inclusive_pure_chain,
    validate_chain,
    validate_tree,
    verdict_from_json,
)
from specs.geometry_spec import Policy, spec_verdict

try:  # numpy is optional for the oracle
    import numpy as np
except ImportError:  # pragma: no cover - numpy is a dflash dependency
    np = None  # type: ignore[assignment]  # the containers below fall back to lists

#: One input in DEEP_EVERY (chosen by CRC, so a reproducer replays the same checks) also
#: checks JSON round trips, require_*, the execution sentinel and the tree structure.
DEEP_EVERY = 16
CONTAINERS = ("list", "tuple", "array", "numpy32", "numpy64", "numpy_strided", "tagged",
              "numpy_float")
#: In a "tagged" list these int32 values stand for non-integers.
TAGS: dict[int, object] = {-(2**31): None, 2**31 - 1: True, 2**31 - 2: 1.0, 2**31 - 3: "0"}


class OracleMismatch(AssertionError):
    """The validator disagreed with the specification or broke an invariant."""


def decode_input(data: bytes) -> tuple[str, object, tuple[int, ...] | Rejection]:
    """``(container, n_actual, entries-or-decoder-rejection)`` for a fuzz input."""
    head = data[:2].ljust(2, b"\0")
    container = CONTAINERS[head[0] & 7]
    nbyte = head[1]
    n_actual: object = {0xFF: None, 0xFE: MAX_SLOTS + 1, 0xFD: -1}.get(nbyte, nbyte)
    body = data[2:]
    if head[0] & 8:  # compact: widen signed bytes to int32 words, then decode as usual
        body = struct.pack(f"<{len(body)}i", *struct.unpack(f"<{len(body)}b", body))
    entries = decode_int32_le(body)
    if nbyte == 0xFC:
        n_actual = MAX_SLOTS + 1
        if not isinstance(entries, Rejection):
            entries = entries + (0,) * max(0, MAX_SLOTS + 1 - len(entries))
    return container, n_actual, entries


def build_container(container: str, entries: tuple[int, ...]) -> tuple[object, list[object]]:
    """The validator's input and the same entries as the plain list the spec reads."""
    if container == "tuple":
        return entries, list(entries)
    if container == "array":
        return array.array("i", entries), list(entries)
    if container == "tagged":
        tagged = [TAGS.get(e, e) for e in entries]
        return tagged, tagged
    if np is not None and container == "numpy32":
        return np.array(entries, dtype="<i4"), list(entries)
    if np is not None and container == "numpy64":
        return np.array(entries, dtype=np.int64), list(entries)
    if np is not None and container == "numpy_strided":
        wide = np.zeros(2 * len(entries), dtype=np.int32)
        wide[::2] = entries
        return wide[::2], list(entries)
    if np is not None and container == "numpy_float":
        return np.array(entries, dtype=np.float64), [float(e) for e in entries]
    return list(entries), list(entries)


def check_one(data: bytes) -> tuple[str, str]:
    """Run one input; returns the (chain, tree) verdict names."""
    container, n_actual, entries = decode_input(data)
    if isinstance(entries, Rejection):  # a partial trailing word: NULL, then fuzz the rest
        tail = (len(data) - 2) % 4
        _expect(entries.reason is RejectReason.NULL and tail != 0 and not data[0] & 8,
                f"decoder rejection {entries} for a whole-word buffer")
        entries = decode_input(data[: len(data) - tail])[2]
        if isinstance(entries, Rejection):
            raise OracleMismatch(f"decoder rejected a whole-word buffer: {entries}")
    parents, plain = build_container(container, entries)
    deep = zlib.crc32(data) % DEEP_EVERY == 0
    names = []
    policies: tuple[tuple[Policy, Any], ...] = (("chain", validate_chain), ("tree", validate_tree))
    for policy, validate in policies:
        verdict = validate(parents, n_actual)
        # typed key: 1 == 1.0 == True in Python, but not to the spec
        typed = (tuple(plain), tuple(map(type, plain)), n_actual, type(n_actual))
        expected = _specified(typed, policy)
        got = _key(verdict)
        _expect(got == expected, f"{policy} {container} {plain[:16]} n={n_actual}: "
                                 f"validator {got} != spec {expected}")
        if deep:
            _check_invariants(verdict, parents, n_actual, policy)
        names.append(got[1] if got[0] == "reject" else policy)
    return names[0], names[1]


@functools.lru_cache(maxsize=1 << 16)
def _specified(typed: tuple[Any, ...], policy: Policy) -> tuple[Any, ...]:
    """The spec is a pure function, and mutated inputs repeat (the same parents under each
    container kind), so its verdicts are cached, keyed by values *and* types; the
    validators always run."""
    plain, _, n_actual, _ = typed
    return spec_verdict(list(plain), n_actual, policy)


def _key(verdict: Any) -> tuple[Any, ...]:
    if isinstance(verdict, Rejection):
        return ("reject", verdict.reason.value, verdict.slot)
    return ("accept", verdict.parents)


def _check_invariants(verdict: Any, parents: object, n_actual: object, policy: str) -> None:
    _expect(verdict_from_json(verdict.to_json()) == verdict, f"JSON round trip of {verdict!r}")
    require = require_chain if policy == "chain" else require_tree
    if isinstance(verdict, Rejection):
        _expect(bool(verdict.message), "empty rejection message")
        try:
            require(parents, n_actual)
        except GeometryError as err:
            _expect(err.rejection == verdict, f"require_{policy} raised {err.rejection}")
        else:
            raise OracleMismatch(f"require_{policy} did not raise for {verdict}")
    else:
        _expect(require(parents, n_actual) == verdict, f"require_{policy} differs")
        _expect(json.loads(verdict.to_json())["parents"] == list(verdict.parents), "JSON parents")
    if policy == "chain":
        ran = []
        run_if_root_inclusive_pure_chain(parents, n_actual, lambda: ran.append(1))
        _expect(len(ran) == isinstance(verdict, ChainGeometry), f"sentinel ran {len(ran)}x")
    if isinstance(verdict, TreeGeometry) and verdict.n_actual <= 64:
        for s in range(1, verdict.n_actual):
            p = verdict.parents[s]
            _expect(s in verdict.children[p] and verdict.depth[s] == verdict.depth[p] + 1,
                    f"tree structure at slot {s}")
        mask = verdict.ancestor_mask()
        _expect(all(mask[i][i] and mask[i][0] for i in range(verdict.n_actual)), "mask diagonal")


def _expect(condition: bool, message: str) -> None:
    if not condition:
        raise OracleMismatch(message)
