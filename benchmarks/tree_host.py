"""The host's share of a tree step, part by part, on this machine's CPU.

A tree step builds its tree on the host between the previous step's read and its verify:
the GPU waits for it. This times each host part of a step at Qwen3.5's vocabulary and a
tree of ``--budget`` nodes grown from ``--depth`` depths of ``--top`` candidates (random
log-probabilities, best first): :func:`best_first_tree` (with its checks of the
candidates and of the tree it builds), :func:`require_tree` (the geometry validator),
the recurrence kernel's table (:func:`tree_table_values`) and the path table
(:func:`tree_path_rows`) that ``TreeTables`` stages, and the host's :func:`accept_tree`.
Median µs over ``--calls`` calls; ``--json`` writes them.

    python benchmarks/tree_host.py [--budget 64] [--calls 300] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import random
import statistics
import time
from collections.abc import Callable

from dflash.geometry import require_tree
from dflash.kernels.tree_paths import tree_path_rows, tree_table_values
from dflash.model.drafters.trees import accept_tree, best_first_tree

VOCAB = 248_320


def _median_us(fn: Callable[[], object], calls: int) -> float:
    fn()
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget", type=int, default=64)
    ap.add_argument("--depth", type=int, default=15)
    ap.add_argument("--top", type=int, default=8)
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    rng = random.Random(0)
    candidates = [
        list(zip(rng.sample(range(VOCAB), args.top),
                 sorted((math.log(rng.random()) for _ in range(args.top)), reverse=True),
                 strict=True))
        for _ in range(args.depth)
    ]
    tree = best_first_tree(5, candidates, args.budget)
    geometry = require_tree(list(tree.parents))
    target = [rng.randrange(VOCAB) for _ in range(len(tree))]
    parts: dict[str, Callable[[], object]] = {
        "best_first_tree": lambda: best_first_tree(5, candidates, args.budget),
        "require_tree": lambda: require_tree(list(tree.parents)),
        "tree_table_values": lambda: tree_table_values(tree.parents),
        "tree_path_rows": lambda: tree_path_rows(geometry, len(tree)),
        "accept_tree": lambda: accept_tree(tree, target),
    }
    rows = {name: _median_us(fn, args.calls) for name, fn in parts.items()}
    rows["total"] = sum(rows.values())
    print(f"tree of {len(tree)} nodes ({args.depth} depths x top {args.top}); median µs")
    for name, us in rows.items():
        print(f"  {name:<18} {us:8.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"python": platform.python_version(), "machine": platform.machine(),
                       "nodes": len(tree), "calls": args.calls, "us": rows}, f, indent=2)


if __name__ == "__main__":
    main()
