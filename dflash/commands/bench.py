"""``dflash bench``: A/B/A comparison of rollback configurations on one model and drafter.

Runs configuration A, then each B configuration, then A again — each as ``--warmup``
unmeasured runs followed by ``--runs`` measured ones — and reports medians, the speed-up of
every B over A (against the mean of the A1 and A2 medians) and the A1/A2 drift. Every run's
tokens are compared with target-only greedy decoding; a speed-up is reported only when
every run is correct. Writes JSON (``--out``) and a PNG plot (``--plot``, needs matplotlib).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

from dflash.commands.generate import Prepared, add_generation_options, prepare, usage_errors
from dflash.execution.policy import RollbackMode, parse_mode


class RunStats(BaseModel):
    model_config = ConfigDict(frozen=True)

    tokens_per_s: float
    decode_s: float
    prefill_s: float
    target_forwards_per_step: float
    effective_forwards_per_step: float | None
    acceptance_rate: float
    avg_commit: float
    steps: int
    fast: int
    replay: int
    replay_after_failure: int
    status: str
    sha256: str
    correct: bool


class Phase(BaseModel):
    model_config = ConfigDict(frozen=True)

    name: str  # "A1", "B1", …, "A2"
    mode: str
    runs: list[RunStats]
    median_tokens_per_s: float
    median_decode_s: float
    target_forwards_per_step: float
    acceptance_rate: float
    checkpoint_bytes: int
    capture_verdict: str


class BenchReport(BaseModel):
    model_config = ConfigDict(frozen=True)

    setup: dict[str, Any]
    oracle_sha256: str
    phases: list[Phase]
    correct: bool  # every measured and warm-up run equals target-only greedy
    drift_a: float  # |A1 - A2| / mean(A1, A2), median tokens/s
    speedup: dict[
        str, float | None
    ]  # B mode -> median tokens/s over mean(A1, A2); None if incorrect
    note: str


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "bench",
        help="A/B/A comparison of rollback configurations",
        description=__doc__.splitlines()[0],
    )
    add_generation_options(p)
    p.add_argument("--a", default="replay", help="configuration A: a rollback mode")
    p.add_argument(
        "--b", default="checkpoint,remap", help="configuration(s) B: comma-separated rollback modes"
    )
    p.add_argument("--runs", type=int, default=3, help="measured runs per phase")
    p.add_argument("--warmup", type=int, default=1, help="unmeasured runs per phase")
    p.add_argument("--out", default="benchmarks/results/bench.json", help="JSON report path")
    p.add_argument(
        "--plot", default="benchmarks/results/bench.png", help="PNG plot path ('' = none)"
    )
    p.add_argument("--json", action="store_true", help="also print the report on stdout")
    p.set_defaults(run=run)


def _phase(name: str, mode: str, results: list[Any], oracle_sha: str) -> Phase:
    runs = [
        RunStats(
            tokens_per_s=r.timings.tokens_per_s,
            decode_s=r.timings.decode_s,
            prefill_s=r.timings.prefill_s,
            target_forwards_per_step=r.target_forwards_per_step,
            effective_forwards_per_step=r.effective_forwards_per_step,
            acceptance_rate=r.acceptance_rate,
            avg_commit=r.avg_commit,
            steps=r.steps,
            fast=r.rollback.fast,
            replay=r.rollback.replay,
            replay_after_failure=r.rollback.replay_after_failure,
            status=r.rollback.status.value,
            sha256=r.sha256,
            correct=r.sha256 == oracle_sha,
        )
        for r in results
    ]
    return Phase(
        name=name,
        mode=mode,
        runs=runs,
        median_tokens_per_s=statistics.median(x.tokens_per_s for x in runs),
        median_decode_s=statistics.median(x.decode_s for x in runs),
        target_forwards_per_step=statistics.median(x.target_forwards_per_step for x in runs),
        acceptance_rate=statistics.median(x.acceptance_rate for x in runs),
        checkpoint_bytes=results[-1].checkpoint_bytes,
        capture_verdict=results[-1].capture.verdict,
    )


def table(report: BenchReport) -> str:
    head = (
        f"{'phase':<6} {'mode':<11} {'tok/s (median)':>15} {'fwd/step':>9} {'accept':>7} "
        f"{'fwd/eff':>8} {'fast/replay/fail':>17} {'ckpt MiB':>9} correct"
    )
    lines = [head, "-" * len(head)]
    for ph in report.phases:
        last = ph.runs[-1]
        eff_value = last.effective_forwards_per_step
        eff = "-" if eff_value is None else f"{eff_value:.2f}"
        lines.append(
            f"{ph.name:<6} {ph.mode:<11} {ph.median_tokens_per_s:>15.2f} "
            f"{ph.target_forwards_per_step:>9.2f} {ph.acceptance_rate:>7.3f} "
            f"{eff:>8} "
            f"{f'{last.fast}/{last.replay}/{last.replay_after_failure}':>17} "
            f"{ph.checkpoint_bytes / 2**20:>9.1f} {all(r.correct for r in ph.runs)}"
        )
    lines.append(f"A1/A2 drift: {report.drift_a:.1%}")
    for mode, s in report.speedup.items():
        lines.append(
            f"speed-up {mode} vs A: "
            + ("not reported (a run was incorrect)" if s is None else f"{s:.2f}x")
        )
    return "\n".join(lines)


def plot(report: BenchReport, path: str) -> str | None:
    """Write the PNG; returns a message instead when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return (
            "matplotlib is not installed; no plot written "
            "(install it with: pip install 'dflash[plot]')"
        )
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    names = [f"{p.name}\n{p.mode}" for p in report.phases]
    ax1.bar(names, [p.median_tokens_per_s for p in report.phases], color="#4c72b0")
    for i, p in enumerate(report.phases):
        ax1.scatter([i] * len(p.runs), [r.tokens_per_s for r in p.runs], color="k", s=10)
    ax1.set_ylabel("decode tokens/s (median; dots: runs)")
    ax1.set_title("A/B/A decode throughput")
    ax2.bar(names, [p.target_forwards_per_step for p in report.phases], color="#dd8452")
    ax2.set_ylabel("target forwards per step")
    ax2.set_title(f"drift A1/A2 {report.drift_a:.1%}")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None


def run(args: argparse.Namespace) -> int:
    deterministic = not args.non_deterministic
    try:
        mode_a = parse_mode(args.a, source="--a")
        modes_b = [parse_mode(m, source="--b") for m in args.b.split(",")]
        if args.runs < 1 or args.warmup < 0:
            raise ValueError(
                f"--runs must be >= 1 and --warmup >= 0 (got {args.runs}, {args.warmup})"
            )
        ready = prepare(args, deterministic=deterministic)
    except usage_errors() as exc:
        print(f"dflash bench: error: {exc}", file=sys.stderr)
        return 2
    try:
        return _bench(args, ready, mode_a, modes_b, deterministic)
    except Exception as exc:  # a failure while measuring: exit 3 with its type, no traceback
        print(f"dflash bench: failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 3


def _bench(
    args: argparse.Namespace,
    ready: Prepared,
    mode_a: RollbackMode,
    modes_b: list[RollbackMode],
    deterministic: bool,
) -> int:
    """The A/B/A phases, the report, its table, JSON and plot; returns the exit status."""
    from dflash.execution.oracle import reference_greedy
    from dflash.execution.policy import RollbackPolicy
    from dflash.execution.results import token_sha256
    from dflash.execution.run import generate

    model, plan, prompt, drafter = ready.model, ready.plan, ready.prompt, ready.drafter
    dtype, devices, acceptance = ready.dtype, ready.devices, ready.acceptance
    oracle = ready.oracle
    if oracle is None:
        oracle = reference_greedy(
            model,
            plan,
            prompt,
            args.max_new_tokens,
            deterministic=deterministic,
            block_size=args.block_size,
        )
    oracle_sha = token_sha256(oracle)

    def measure(mode: RollbackMode, name: str) -> Phase:
        policy = RollbackPolicy(mode=mode, deterministic=deterministic)
        results = []
        for i in range(args.warmup + args.runs):
            r = generate(
                model,
                drafter,
                prompt,
                plan=plan,
                max_new_tokens=args.max_new_tokens,
                block_size=args.block_size,
                policy=policy,
                eos_id=args.eos_id,
            )
            print(
                f"dflash bench: {name} {mode} run {i + 1}/{args.warmup + args.runs}: "
                f"{r.timings.tokens_per_s:.2f} tok/s, sha {r.sha256[:12]}",
                file=sys.stderr,
            )
            if r.sha256 != oracle_sha:
                print(
                    f"dflash bench: {name} {mode} run {i + 1} differs from target-only greedy",
                    file=sys.stderr,
                )
            results.append(r)
        warm_ok = all(r.sha256 == oracle_sha for r in results[: args.warmup])
        phase = _phase(name, mode, results[args.warmup :], oracle_sha)
        if not warm_ok:  # a wrong warm-up run makes the phase incorrect too
            phase = phase.model_copy(
                update={"runs": [x.model_copy(update={"correct": False}) for x in phase.runs]}
            )
        return phase

    phases = [measure(mode_a, "A1")]
    phases += [measure(m, f"B{i + 1}") for i, m in enumerate(modes_b)]
    phases.append(measure(mode_a, "A2"))
    correct = all(r.correct for p in phases for r in p.runs)
    a1, a2 = phases[0].median_tokens_per_s, phases[-1].median_tokens_per_s
    a_mean = (a1 + a2) / 2
    report = BenchReport(
        setup={
            "model": args.model,
            "dtype": str(dtype).replace("torch.", ""),
            "devices": devices,
            "layer_split": list(plan.split),
            "draft": args.draft,
            "acceptance_per_slot": acceptance if args.draft == "synthetic" else None,
            "drafted_acceptance_requested": args.drafted_acceptance,
            "prompt_len": len(prompt),
            "max_new_tokens": args.max_new_tokens,
            "block_size": args.block_size,
            "deterministic": deterministic,
            "warmup": args.warmup,
            "runs": args.runs,
        },
        oracle_sha256=oracle_sha,
        phases=phases,
        correct=correct,
        drift_a=abs(a1 - a2) / a_mean if a_mean else 0.0,
        speedup={
            p.mode: (p.median_tokens_per_s / a_mean if correct and a_mean else None)
            for p in phases[1:-1]
        },
        note=(
            "synthetic drafter: acceptance chosen by configuration, not measured"
            if args.draft == "synthetic"
            else f"drafter {args.draft}"
        ),
    )
    print(table(report), file=sys.stderr)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report.model_dump(), indent=2) + "\n")
    if args.plot:
        message = plot(report, args.plot)
        if message:
            print(f"dflash bench: {message}", file=sys.stderr)
    if args.json:
        sys.stdout.write(report.model_dump_json() + "\n")
    return 0 if correct else 1
