"""Where the main job's CPU step goes, and what the verify-window rule is worth.

Runs the main job's generation (the default pair, the default prompt, ``--max-new-tokens``
tokens, checkpoint rollback, plain greedy measured after it as ``dflash generate`` does)
``--reps`` times in one process for each window rule, alternating the rules:

- ``confidence``: the verify window follows the drafter's confidence through the step's
  cost model, priced at the generation's running rate (the shipped rule);
- ``floor-0.1``: the rule it replaced, kept here for the comparison: the tile-aligned
  window, cut where the product of the guesses' probabilities falls below 0.1 (at least
  one guess);
- ``commit-cap``: the drafter's confidence hidden from the engine, so the window falls
  back to the previous step's commit + 4 (the rule for drafters without probabilities).

``--heldout N`` runs N held-out standard-library prompts instead (each run sums their
decode times). Per rule: the median speed-up over plain greedy and its range, the
average commit, and a step's wall time split into the verify forwards, the drafter's
proposals and the rest of the step (acceptance, rollback, bookkeeping), each the median
over the runs, next to a plain decode's. Every run must be lossless (parity). ``--json``
writes the rows.

    python3 benchmarks/cpu_step.py [--reps 6] [--max-new-tokens 64] [--threads 2] [--heldout N]
        [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

import dflash.execution.window as window
from dflash.commands.harness import Harness
from dflash.commands.settings import DEFAULT_PROMPT
from dflash.execution import RollbackPolicy, SpecDecoder, plan_shards
from dflash.execution.session import build_drafter, build_model, encode_prompt
from dflash.execution.shards import ShardedTarget
from dflash.execution.window import tile_window
from dflash.model import tiles
from dflash.model.drafters import DFlashDrafter

RULES = ("confidence", "floor-0.1", "commit-cap")


def floor_rule(
    start: int, block: int, last: tuple[int, int] | None = None,
    confidence: Sequence[float] | None = None, rate: float = window.DEFAULT_RATE,
) -> int:
    """The previous confidence rule (``floor-0.1``); without confidence, the shipped one."""
    if confidence is None:
        return tile_window(start, block, last)
    room = tiles.TILE_ROWS - start % tiles.TILE_ROWS
    size = room if window.MIN_WINDOW <= room < block else block
    held, joint = 0, 1.0
    for c in confidence:
        joint *= c
        if joint < 0.1:
            break
        held += 1
    return min(size, 1 + max(1, held))


def timed(
    cls: type, name: str, key: Callable[[tuple[Any, ...]], str], into: dict[str, float]
) -> None:
    """Wrap ``cls.name`` so every call adds its wall time to ``into[key(args)]``."""
    original = getattr(cls, name)

    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return original(self, *args, **kwargs)
        finally:
            into[key(args)] += time.perf_counter() - t0

    setattr(cls, name, wrapper)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=6)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--heldout", type=int, default=0,
                    help="instead of the main job's prompt, N held-out standard-library "
                    "prompts (benchmarks/drafter_tau.py's, seed 7): sums over them")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = build_model("default", seed=0, dtype=torch.float32, device="cpu")
    plan = plan_shards(model.config.num_hidden_layers, "cpu")
    vocab = model.config.vocab_size
    prompt = encode_prompt(
        "default", vocab, text=DEFAULT_PROMPT, ids=None, length=None, seed=0, allow_bytes=False
    )
    n = args.max_new_tokens
    prompts = [prompt]
    if args.heldout:
        sys.path.insert(0, str(Path(__file__).parent))
        from drafter_tau import default_heldout_prompts

        prompts = default_heldout_prompts(args.heldout)
    drafter, _ = build_drafter("dflash", model, prompt, plan=plan, acceptance=0.0, seed=0,
                               max_new_tokens=n, block_size=16, model_spec="default")
    seconds: dict[str, float] = defaultdict(float)
    timed(ShardedTarget, "forward", lambda a: str(a[1]), seconds)  # mode: decode / verify / …
    timed(DFlashDrafter, "propose", lambda a: "propose", seconds)
    timed(SpecDecoder, "step", lambda a: "step", seconds)
    scored = DFlashDrafter.confidence
    runs: dict[str, list[dict[str, float]]] = {rule: [] for rule in RULES}
    for _ in range(args.reps):
        for rule in RULES:
            DFlashDrafter.confidence = scored if rule != "commit-cap" else (  # type: ignore[method-assign]  # the A/B switch
                lambda self: None
            )
            # the A/B switch: the name CpuWindow calls
            window.tile_window = floor_rule if rule == "floor-0.1" else tile_window
            seconds.clear()
            spec_s = greedy_s = 0.0
            steps = decodes = 0
            committed = 0.0
            for p in prompts:  # one prompt, or the held-out ones: their sums
                r = Harness(model, drafter, p, plan, n, 16).against_greedy(
                    RollbackPolicy(mode="checkpoint")
                )
                if not r.parity:
                    raise SystemExit(f"parity false under the {rule} rule")
                spec_s += r.timings.decode_s
                greedy_s += r.timings.greedy_decode_s or 0.0
                steps += r.steps
                committed += r.avg_commit * r.steps  # the tokens its steps committed
                decodes += len(r.tokens) - 1
            rest = seconds["step"] - seconds["verify"] - seconds["propose"] - seconds["replay"]
            runs[rule].append({
                "speedup": greedy_s / spec_s, "avg_commit": committed / steps,
                "steps": steps, "step_ms": seconds["step"] / steps * 1e3,
                "verify_ms": seconds["verify"] / steps * 1e3,
                "propose_ms": seconds["propose"] / steps * 1e3,
                "replay_ms": seconds["replay"] / steps * 1e3, "rest_ms": rest / steps * 1e3,
                "decode_ms": seconds["decode"] / max(1, decodes) * 1e3,
            })
    DFlashDrafter.confidence = scored  # type: ignore[method-assign]  # restored
    window.tile_window = tile_window  # restored
    rows = []
    for rule, got in runs.items():
        med = {k: statistics.median(run[k] for run in got) for k in got[0]}
        speedups = sorted(run["speedup"] for run in got)
        rows.append({"rule": rule, "median": med, "speedups": speedups})
        print(f"{rule:<11} speed-up {med['speedup']:.2f}x ({speedups[0]:.2f}-{speedups[-1]:.2f})"
              f"  commit {med['avg_commit']:.2f}  step {med['step_ms']:.1f} ms = verify "
              f"{med['verify_ms']:.1f} + drafter {med['propose_ms']:.1f} + replay "
              f"{med['replay_ms']:.1f} + rest {med['rest_ms']:.1f}  | decode "
              f"{med['decode_ms']:.1f} ms ({med['step_ms'] / med['decode_ms']:.2f} decodes a step)",
              flush=True)
    if args.json:
        env = {"machine": platform.processor() or platform.machine(), "threads": args.threads,
               "python": platform.python_version(), "torch": torch.__version__,
               "max_new_tokens": n, "reps": args.reps}
        Path(args.json).write_text(json.dumps({"env": env, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
