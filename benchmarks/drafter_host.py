"""The host's time of one drafter step against the context length (CPU, no model).

A step of speculative decoding with a host drafter waits for the drafter's proposal
before the next verify is enqueued, so a drafter whose step grows with the context adds
that time to every step at long context. For each drafter that reads no model (the
synthetic drafter with a sequence oracle, prompt lookup), this times ``propose`` on a
context that grows by a few tokens per call, as the engine's does, at each length, and
prints the milliseconds per step. CPU only; a few seconds.

    python benchmarks/drafter_host.py [--lengths 1024,16384,131072] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import time
from typing import Any

from dflash.model.drafters import PromptLookupDrafter, SyntheticDrafter

VOCAB = 248_320


def _per_step(drafter: Any, context: list[int], tail: list[int], steps: int) -> float:
    """Milliseconds per ``propose`` (block 16), the context growing by one token a call
    (the engine hands the drafter a fresh copy of its context each step)."""
    drafter.propose(list(context), tail[0], 16)
    start = time.perf_counter()
    for i in range(steps):
        context.append(tail[i])
        drafter.propose(list(context), tail[i + 1], 16)
    return (time.perf_counter() - start) / steps * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="1024,16384,131072")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    rows = []
    print("| context | synthetic ms / step | prompt lookup ms / step |")
    print("|---:|---:|---:|")
    for length in (int(x) for x in args.lengths.split(",")):
        rng = random.Random(length)
        tokens = [rng.randrange(VOCAB) for _ in range(length + args.steps + 2)]
        synthetic = _per_step(SyntheticDrafter(tokens, 0.874, VOCAB), tokens[:length],
                              tokens[length:], args.steps)
        lookup = _per_step(PromptLookupDrafter(), tokens[:length], tokens[length:], args.steps)
        rows.append({"context": length, "synthetic_ms": synthetic, "prompt_lookup_ms": lookup})
        print(f"| {length:,} | {synthetic:.3f} | {lookup:.3f} |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"python": platform.python_version(), "machine": platform.machine(),
                       "steps": args.steps, "rows": rows}, f, indent=2)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
