"""Exhaustive equivalence of the validators and the specification on small inputs.

Every parent array of length 0..6 with entries in [-2, 6], with every ``n_actual`` in
``None, 0, 1, …, length+1``, under both policies:

* the validator's verdict (reason and slot, or the accepted parents) equals
  :func:`specs.geometry_spec.spec_verdict` (the prefix definition of rejection);
* for every array, the validator accepts exactly when the parent graph is accepted by
  :func:`specs.geometry_spec.accepted_as_graph` (the reachability definition), checked
  here explicitly and not only through ``spec_verdict``'s own consistency check.

Run ``python -m specs.check_exhaustive [--max-len N]`` (prints the bound and the number
of inputs checked); the CPU suite runs the same check in ``tests/cpu/geometry``.
"""

from __future__ import annotations

import argparse
import itertools
import multiprocessing
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from typing import Any

from dflash.geometry import Rejection, validate_chain, validate_tree
from specs.geometry_spec import Policy, accepted_as_graph, spec_verdict

MAX_LEN = 6
VALUES = tuple(range(-2, 7))  # [-2, 6]
VALIDATORS = {"chain": validate_chain, "tree": validate_tree}


def verdict_key(verdict: Any) -> tuple[Any, ...]:
    """A validator verdict in the spec's shape."""
    if isinstance(verdict, Rejection):
        return ("reject", verdict.reason.value, verdict.slot)
    return ("accept", verdict.parents)


def check_chunk(policy: Policy, first: int | None, max_len: int = MAX_LEN) -> tuple[int, int]:
    """Check every array starting with ``first`` (None: the empty array), up to length
    ``max_len``; returns ``(inputs checked, arrays accepted)``, raises AssertionError on
    a mismatch."""
    validate = VALIDATORS[policy]
    arrays: Any = [()] if first is None else (
        (first, *tail) for length in range(1, max_len + 1)
        for tail in itertools.product(VALUES, repeat=length - 1))
    checked = accepted = 0
    full: dict[tuple[int, ...], tuple[Any, ...]] = {}  # arrays arrive shortest first
    for arr in arrays:
        length = len(arr)
        full[arr] = spec_verdict(arr, None, policy)
        if length:
            by_graph = accepted_as_graph(arr, length, policy)
            by_validator = not isinstance(validate(arr), Rejection)
            if by_graph != by_validator:
                raise AssertionError(
                    f"{validate.__name__}({list(arr)}) {'accepted' if by_validator else 'rejected'}"
                    f" it; the parent graph is {'' if by_graph else 'not '}an accepted {policy}")
            accepted += by_graph
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
    return checked, accepted


def expected_count(max_len: int = MAX_LEN) -> int:
    """(arrays × n_actual values) per policy."""
    return sum(len(VALUES) ** k * (k + 3) for k in range(max_len + 1))


def expected_accepted(policy: Policy, max_len: int = MAX_LEN) -> int:
    """Accepted arrays per policy: one chain per length; (k-1)! topologically numbered
    trees of k slots (slot s picks any of its s predecessors; all lie in VALUES)."""
    if policy == "chain":
        return max_len
    total, factorial = 0, 1
    for k in range(1, max_len + 1):
        total += factorial
        factorial *= k
    return total


def run(workers: int = 2, max_len: int = MAX_LEN) -> dict[str, tuple[int, int]]:
    """``{policy: (inputs checked, arrays accepted)}``."""
    policies: tuple[Policy, ...] = ("chain", "tree")
    jobs = [(policy, first) for policy in policies for first in (None, *VALUES)]
    counts = {"chain": [0, 0], "tree": [0, 0]}
    if workers <= 1:
        results = [(policy, check_chunk(policy, first, max_len)) for policy, first in jobs]
    else:
        context = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(max_workers=workers, mp_context=context) as pool:
            futures = [(policy, pool.submit(check_chunk, policy, first, max_len))
                       for policy, first in jobs]
            try:
                results = [(policy, future.result()) for policy, future in futures]
            except BaseException:  # the first mismatch ends the check: drop queued chunks
                pool.shutdown(wait=False, cancel_futures=True)
                raise
    for policy, (checked, accepted) in results:
        counts[policy][0] += checked
        counts[policy][1] += accepted
    return {policy: (c[0], c[1]) for policy, c in counts.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m specs.check_exhaustive")
    parser.add_argument("--max-len", type=int, default=MAX_LEN)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args(argv)
    start = time.perf_counter()
    try:
        counts = run(args.workers, args.max_len)
    except AssertionError as err:
        print(f"MISMATCH: {err}")
        return 1
    print(f"bound: parent arrays of length <= {args.max_len}, entries in "
          f"[{VALUES[0]}, {VALUES[-1]}], n_actual in None, 0..length+1")
    ok = True
    policies: tuple[Policy, ...] = ("chain", "tree")
    for policy in policies:
        count, accepted = counts[policy]
        good = (count == expected_count(args.max_len)
                and accepted == expected_accepted(policy, args.max_len))
        ok &= good
        print(f"{policy}: {count} inputs, validator == spec; {accepted} arrays accepted, "
              f"validator == graph definition on every array ({'ok' if good else 'INCOMPLETE'})")
    print(f"{time.perf_counter() - start:.1f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
