"""The main job's speculative decode in steady state: the capture gate's step against the rest.

Builds what ``dflash generate`` builds (the default pair, its prompt, ``--draft``,
checkpoint rollback; bf16 and CUDA graphs on a GPU) and keeps one speculative and one
greedy target across generations, as ``--repeats`` does: ``--warmup`` untimed
generations, then ``--runs`` timed ones, each followed by a timed plain greedy decode. Per
run it reports the speed-up over plain greedy, the decode times, and the wall time of
every step: the first step and the median of the others. Every run must be lossless.
``--json`` writes the rows.

``--engine fresh`` (the default): every generation on a new engine, as separate
``generate`` calls make them, so each generation's first step is its capture gate's.
``--engine kept``: every generation on one engine (``Harness.engine``, a
long-lived one serving request after request, as the CLI's repeats and warm-up do): the
gate runs in its first generation only (a warm-up one when ``--warmup`` is at least 1),
and every later generation's first step is a fast step.

    python3 benchmarks/steady_step.py [--max-new-tokens 256] [--warmup 2] [--runs 3]
        [--draft dflash+lookup] [--engine fresh|kept] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from dflash.cli import build_parser
from dflash.commands.generate import prepare
from dflash.commands.harness import Harness
from dflash.execution import RollbackPolicy, SpecDecoder


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--draft", default="dflash+lookup")
    ap.add_argument("--engine", choices=("fresh", "kept"), default="fresh")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    n = args.max_new_tokens
    cli = ["generate", "--max-new-tokens", str(n), "--draft", args.draft]
    ready = prepare(build_parser("generate").parse_args(cli))
    policy = RollbackPolicy(mode="checkpoint")
    block = 16
    harness = Harness.kept(ready.model, ready.drafter, ready.prompt, ready.plan,
                           max_new_tokens=n, block_size=block, eos_id=ready.eos_id,
                           greedy_tokens=n)
    generations: list[list[float]] = []  # per generation, the wall time of each step
    step, prefill = SpecDecoder.step, SpecDecoder.prefill

    def timed_step(self: SpecDecoder) -> list[int]:
        t0 = time.perf_counter()
        out = step(self)
        generations[-1].append(time.perf_counter() - t0)
        return out

    def noted_prefill(self: SpecDecoder, prompt: Any) -> int:
        generations.append([])
        return prefill(self, prompt)

    SpecDecoder.step = timed_step  # type: ignore[method-assign]  # the benchmark's timer
    SpecDecoder.prefill = noted_prefill  # type: ignore[method-assign]  # a new generation
    engine = harness.engine(policy) if args.engine == "kept" else None
    rows = []
    try:
        for _ in range(args.warmup):
            harness.against_greedy(policy, engine=engine)
        del generations[:]
        for _ in range(args.runs):
            r = harness.against_greedy(policy, engine=engine)
            if r.parity is not True:
                raise SystemExit(f"not lossless: parity {r.parity}")
            assert r.timings.greedy_decode_s is not None and r.speedup_vs_greedy is not None
            steps_s = generations[-1]
            rows.append({
                "speedup": r.speedup_vs_greedy,
                "decode_ms": r.timings.decode_s * 1e3,
                "greedy_decode_ms": r.timings.greedy_decode_s * 1e3,
                "steps": r.steps,
                "avg_commit": r.avg_commit,
                "first_step_ms": steps_s[0] * 1e3,
                "median_other_step_ms": statistics.median(steps_s[1:]) * 1e3,
            })
            print(
                f"speed-up {r.speedup_vs_greedy:.3f}x  decode {rows[-1]['decode_ms']:.1f} ms  "
                f"greedy {rows[-1]['greedy_decode_ms']:.1f} ms  steps {r.steps}  first step "
                f"{rows[-1]['first_step_ms']:.2f} ms  other steps (median) "
                f"{rows[-1]['median_other_step_ms']:.3f} ms",
                flush=True,
            )
    finally:
        SpecDecoder.step, SpecDecoder.prefill = step, prefill  # type: ignore[method-assign]
    if args.json:
        device = ready.plan.devices[0]
        meta = {
            "device": torch.cuda.get_device_name() if device.startswith("cuda") else "cpu",
            "python": platform.python_version(),
            "torch": torch.__version__,
            "max_new_tokens": n,
            "draft": args.draft,
            "warmup": args.warmup,
            "engine": args.engine,
        }
        Path(args.json).write_text(json.dumps({**meta, "runs": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
