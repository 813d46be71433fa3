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
``--engine kept``: one ``generate`` call with ``--warmup + --runs`` repeats, which share
one engine (a long-lived one serving request after request): the gate runs in its first
generation only (a warm-up one when ``--warmup`` is at least 1), and every later
generation's first step is a fast step.

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
from dflash.execution import RollbackPolicy, SpecDecoder, generate
from dflash.execution.oracle import greedy_target
from dflash.execution.run import spec_target


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
    spec = spec_target(ready.model, ready.plan, len(ready.prompt), n, block, graphs=None)
    greedy = greedy_target(ready.model, ready.plan, len(ready.prompt), n, graphs=None)
    kwargs: dict[str, Any] = dict(
        plan=ready.plan, max_new_tokens=n, block_size=block, policy=policy,
        eos_id=ready.eos_id, graphs=None, baseline=True, target=spec, greedy_target=greedy,
    )
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
    #: spec s, greedy s, speed-up, steps, average commit (a repeat reports no commit of its own)
    runs: list[tuple[float, float, float, int, float | None]] = []
    try:
        if args.engine == "fresh":
            for _ in range(args.warmup):
                generate(ready.model, ready.drafter, ready.prompt, **kwargs)
            del generations[:]
            for _ in range(args.runs):
                r = generate(ready.model, ready.drafter, ready.prompt, **kwargs)
                if r.parity is not True:
                    raise SystemExit(f"not lossless: parity {r.parity}")
                assert r.timings.greedy_decode_s is not None and r.speedup_vs_greedy is not None
                runs.append((r.timings.decode_s, r.timings.greedy_decode_s,
                             r.speedup_vs_greedy, r.steps, r.avg_commit))
        else:
            r = generate(ready.model, ready.drafter, ready.prompt,
                         repeats=args.warmup + args.runs, **kwargs)
            if r.parity is not True:
                raise SystemExit(f"not lossless: parity {r.parity}")
            del generations[: args.warmup]
            pairs = list(zip(r.timings.decode_runs_s, r.timings.greedy_decode_runs_s,
                             strict=True))[args.warmup:]
            for (spec_s, greedy_s), steps_s in zip(pairs, generations, strict=True):
                runs.append((spec_s, greedy_s, greedy_s / spec_s, len(steps_s), None))
    finally:
        SpecDecoder.step, SpecDecoder.prefill = step, prefill  # type: ignore[method-assign]
    rows = []
    for (spec_s, greedy_s, speedup, steps, commit), steps_s in zip(runs, generations, strict=True):
        rows.append({
            "speedup": speedup,
            "decode_ms": spec_s * 1e3,
            "greedy_decode_ms": greedy_s * 1e3,
            "steps": steps,
            "avg_commit": commit,
            "first_step_ms": steps_s[0] * 1e3,
            "median_other_step_ms": statistics.median(steps_s[1:]) * 1e3,
        })
        print(
            f"speed-up {speedup:.3f}x  decode {spec_s * 1e3:.1f} ms  greedy "
            f"{greedy_s * 1e3:.1f} ms  steps {steps}  first step {steps_s[0] * 1e3:.2f} ms  "
            f"other steps (median) {rows[-1]['median_other_step_ms']:.3f} ms",
            flush=True,
        )
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
