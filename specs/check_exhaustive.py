"""Exhaustive equivalence of the validators and the specification on small inputs.

Every parent array of length 0..6 with entries in [-2, 6], with every ``n_actual`` in
``None, 0, 1, …, length+1``, under both policies: the validator's verdict (reason and
slot, or the accepted parents) must equal :func:`specs.geometry_spec.spec_verdict`.

Run ``python -m specs.check_exhaustive`` (prints the bound and the number of inputs
checked); the CPU suite runs the same check in ``tests/cpu/geometry``.
"""

from __future__ import annotations

import itertools
import multiprocessing
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from typing import Any

from dflash.geometry import Rejection, validate_chain, validate_tree
from specs.geometry_spec import Policy, spec_verdict

MAX_LEN = 6
VALUES = tuple(range(-2, 7))  # [-2, 6]
VALIDATORS = {"chain": validate_chain, "tree": validate_tree}


def verdict_key(verdict: Any) -> tuple[Any, ...]:
    """A validator verdict in the spec's shape."""
    if isinstance(verdict, Rejection):
        return ("reject", verdict.reason.value, verdict.slot)
    return ("accept", verdict.parents)


def check_chunk(policy: Policy, first: int | None) -> int:
    """Check every array starting with ``first`` (None: the empty array); returns the
    number of (array, n_actual) inputs checked, raises AssertionError on a mismatch."""
    validate = VALIDATORS[policy]
    arrays: Any = [()] if first is None else (
        (first, *tail) for length in range(1, MAX_LEN + 1)
        for tail in itertools.product(VALUES, repeat=length - 1))
    checked = 0
    full: dict[tuple[int, ...], tuple[Any, ...]] = {}  # arrays arrive shortest first
    for arr in arrays:
        length = len(arr)
        full[arr] = spec_verdict(arr, None, policy)
        for n in (None, *range(length + 2)):
            if n is None or 0 < n <= length:
                # entries past n_actual are ignored by definition: the spec's verdict is
                # that of the prefix, which was itself checked as an array of length n
                expected = full[arr if n is None else arr[:n]]
            else:
                expected = spec_verdict(arr, n, policy)
            got = verdict_key(validate(arr, n))
            if got != expected:
                raise AssertionError(
                    f"{validate.__name__}({list(arr)}, n_actual={n}) gave {got}, spec {expected}")
            checked += 1
    return checked


def expected_count() -> int:
    """(arrays × n_actual values) per policy."""
    return sum(len(VALUES) ** k * (k + 3) for k in range(MAX_LEN + 1))


def run(workers: int = 2) -> dict[str, int]:
    policies: tuple[Policy, ...] = ("chain", "tree")
    jobs = [(policy, first) for policy in policies for first in (None, *VALUES)]
    counts = {"chain": 0, "tree": 0}
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=workers, mp_context=context) as pool:
        futures = [(policy, pool.submit(check_chunk, policy, first)) for policy, first in jobs]
        for policy, future in futures:
            counts[policy] += future.result()
    return counts


def main() -> int:
    start = time.perf_counter()
    counts = run()
    print(f"bound: parent arrays of length <= {MAX_LEN}, entries in [{VALUES[0]}, {VALUES[-1]}], "
          f"n_actual in None, 0..length+1")
    for policy, count in counts.items():
        status = "ok" if count == expected_count() else "INCOMPLETE"
        print(f"{policy}: {count} inputs, validator == spec ({status})")
    print(f"{time.perf_counter() - start:.1f} s")
    return 0 if all(c == expected_count() for c in counts.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
