"""Hypothesis harness: structured inputs for the same oracle, driven by ``fuzz_one_input``.

The strategy builds parent arrays that are mostly near-valid (small entries, chains and
trees with a few edits) and encodes them in the oracle's byte layout, so random bytes fed
to :func:`fuzz_one_input` explore the interesting corner of the input space.
"""

from __future__ import annotations

import random
import struct
import time
from collections.abc import Callable
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fuzz.stats import Recorder

ENTRY = st.one_of(st.integers(-3, 12), st.integers(-(2**31), 2**31 - 1))


@st.composite
def parent_arrays(draw: st.DrawFn) -> list[int]:
    n = draw(st.integers(0, 24))
    if draw(st.booleans()):  # a valid chain or tree, then a few edits
        base = [-1] + [s - 1 if draw(st.booleans()) else draw(st.integers(0, s - 1))
                       for s in range(1, n + 1)]
        for _ in range(draw(st.integers(0, 2))):
            if base:
                base[draw(st.integers(0, len(base) - 1))] = draw(ENTRY)
        return base
    return draw(st.lists(ENTRY, max_size=n))


@st.composite
def encoded_inputs(draw: st.DrawFn) -> bytes:
    entries = draw(parent_arrays())
    container = draw(st.integers(0, 7))
    nbyte = draw(st.one_of(st.just(0xFF), st.integers(0, len(entries) + 2), st.integers(0, 255)))
    return bytes([container, nbyte]) + struct.pack(f"<{len(entries)}i", *entries)


def make_target(recorder: Recorder) -> Callable[[bytes], Any]:
    """A Hypothesis test whose ``.hypothesis.fuzz_one_input`` feeds ``recorder``."""

    @settings(database=None, suppress_health_check=list(HealthCheck), deadline=None)
    @given(encoded_inputs())
    def target(data: bytes) -> None:
        recorder.run(data)

    fuzz_one_input: Callable[[bytes], Any] = target.hypothesis.fuzz_one_input  # type: ignore[attr-defined]
    return fuzz_one_input


def fuzz_for(recorder: Recorder, seconds: float, runs: int = 0, seed: int = 0) -> None:
    """Feed random byte strings to ``fuzz_one_input`` until the time or run budget ends."""
    fuzz_one_input = make_target(recorder)
    rng = random.Random(seed)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and not (runs and recorder.executions >= runs):
        for _ in range(64):
            fuzz_one_input(rng.randbytes(rng.randrange(8, 256)))
