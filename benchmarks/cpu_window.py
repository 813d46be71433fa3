"""The CPU verify-window cost model (``dflash.execution.window``), measured on the default pair.

A CPU step verifies a window of the draft (:func:`dflash.execution.window.tile_window`) priced
by :func:`dflash.execution.window.verify_cost` in plain decodes: ``STEP_COST`` for the step's
fixed part, ``TOKEN_COST`` per verified token after the first, ``TILE_COST`` for a second
16-row position tile. This measures those prices on this machine, with the engine's own
target (:class:`ShardedTarget`, every shard on CPU) and drafter:

- plain decodes (one after another from the prompt), and verifies of ``T = 1 … 16``
  tokens at positions whose row in their tile is 0, 8 and 14 (each verify undone by a
  snapshot restore, so every one starts at the same position); ``TOKEN_COST`` is the
  mean slope of the verify time over the windows that stay in one tile, ``TILE_COST``
  the mean jump where a window first enters the next tile, less one token's slope;
- the drafter's proposal (``--new-rows`` new feature rows after a context of the prompt's
  length): the step's fixed part measured here is (one-token verify + proposal) /
  decode; ``STEP_COST`` also holds the step's bookkeeping (acceptance, rollback), which
  this does not time — ``benchmarks/cpu_step.py``'s ``rest`` column measures it.

(The shipped ``STEP_COST`` is printed beside the first, bookkeeping included.) Each
time is the fastest of ``--reps`` runs (other load on the machine only adds to a
time). ``--json`` writes every time and the fitted
constants next to the shipped ones.

    python3 benchmarks/cpu_window.py [--threads 2] [--reps 15] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from dflash.commands.settings import DEFAULT_PROMPT
from dflash.execution import plan_shards, window
from dflash.execution.engine import chain_of
from dflash.execution.session import build_drafter, build_model, encode_prompt
from dflash.execution.shards import ShardedTarget

OFFSETS = (0, 8, 14)  # the verify's first row within its 16-row tile
WINDOWS = tuple(range(1, 17))


def best_ms(fn: Callable[[], object], reps: int) -> float:
    """The fastest of ``reps`` runs (after two untimed ones), in ms: the cost of the work
    itself on a machine that other load slows down at random."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--new-rows", type=int, default=3, help="feature rows per proposal")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = build_model("default", seed=0, dtype=torch.float32, device="cpu")
    plan = plan_shards(model.config.num_hidden_layers, "cpu")
    prompt = encode_prompt(
        "default", model.config.vocab_size, text=DEFAULT_PROMPT, ids=None, length=None, seed=0,
        allow_bytes=False,
    )
    target = ShardedTarget(model, plan, max_len=160, max_draft=16)
    taps = (1, 3, 5)

    def at(position: int) -> None:  # a fresh prefill of `position` prompt tokens
        target.forward((prompt * 8)[:position], "prefill", 0)

    def decodes(position: int, n: int) -> list[float]:  # n decodes in a row from `position`
        times = []
        for i in range(n):
            t0 = time.perf_counter()
            target.forward([5], "decode", position + i)
            times.append(time.perf_counter() - t0)
        return times[2:]

    def verify(position: int, t: int) -> None:
        target.forward([5] * t, "verify", position, geometry=chain_of(t), taps=taps)
        for shard in target.shards:
            shard.caches.pool.restore_pre_verify()
            shard.truncate_kv(position)

    base = 64
    rows: dict[str, float] = {}
    with torch.inference_mode():
        at(base)
        rows["decode"] = min(decodes(base, args.reps + 2)) * 1e3
        for off in OFFSETS:
            at(base + off)
            for t in WINDOWS:
                rows[f"verify r{off} T{t}"] = best_ms(
                    lambda p=base + off, n=t: verify(p, n), args.reps
                )
            print(f"row {off:2d}: " + " ".join(
                f"{rows[f'verify r{off} T{t}']:.1f}" for t in WINDOWS), flush=True)
    drafter, _ = build_drafter("dflash", model, prompt, plan=plan, acceptance=0.0, seed=0,
                               max_new_tokens=64, block_size=16, model_spec="default")
    feats = torch.randn(base + args.new_rows, 3 * model.config.hidden_size)
    context = (prompt * 8)[: base + args.new_rows]
    drafter.reset()
    drafter.propose(context[:base], 7, 16, feats[:base])

    def propose() -> None:
        drafter.host._tokens = drafter.host._tokens[:base]  # the same new rows every time
        drafter.propose(context, 7, 16, feats[base:])

    rows["propose"] = best_ms(propose, args.reps)
    d = rows["decode"]
    slopes, jumps = [], []
    for off in OFFSETS:
        room = 16 - off
        times = [rows[f"verify r{off} T{t}"] for t in WINDOWS]
        slopes += [(times[t] - times[t - 1]) / d for t in range(1, room)]  # within the tile
    token = statistics.mean(slopes)
    for off in OFFSETS:
        room = 16 - off
        if room < 16:
            jumps.append((rows[f"verify r{off} T{room + 1}"] - rows[f"verify r{off} T{room}"])
                         / d - token)
    fitted = {
        "STEP_COST without bookkeeping": (rows["verify r0 T1"] + rows["propose"]) / d,
        "TOKEN_COST": token,
        "TILE_COST": statistics.mean(jumps),
    }
    shipped = {"STEP_COST without bookkeeping": window.STEP_COST,
               "TOKEN_COST": window.TOKEN_COST, "TILE_COST": window.TILE_COST}
    print(f"decode {d:.2f} ms, one-token verify {rows['verify r0 T1']:.2f} ms, proposal "
          f"{rows['propose']:.2f} ms")
    for name, value in fitted.items():
        print(f"{name:<29} measured {value:.3f}   shipped {shipped[name]:.3f}")
    if args.json:
        env = {"machine": platform.processor() or platform.machine(), "threads": args.threads,
               "python": platform.python_version(), "torch": torch.__version__,
               "reps": args.reps}
        Path(args.json).write_text(json.dumps(
            {"env": env, "ms": rows, "measured": fitted, "shipped": shipped}, indent=2) + "\n")


if __name__ == "__main__":
    main()
