"""``dflash bench``: A/B/A comparison of rollback configurations on one model and drafter.

Runs configuration A, then each B configuration, then A again — each as ``--warmup``
unmeasured runs followed by ``--runs`` measured ones — and reports medians, the speed-up of
every B over A (against the mean of the A1 and A2 medians) and the A1/A2 drift. Then plain
target-only greedy decoding of the same tokens (same shards, devices and CUDA-graph setting)
is timed with the same warm-up and runs, and every configuration's speed-up over its median
is reported too. Every run's tokens are compared with target-only greedy decoding; a
speed-up is reported only when every run is correct.

Output: the table goes to stderr. Without ``--out`` the JSON report goes to stdout and no
file is written; ``--out PATH`` writes the JSON to PATH and a PNG plot beside it (PATH with
the suffix ``.png``, or ``--plot PNG``; ``--plot ''`` for none; the plot needs matplotlib,
which ``bash scripts/run.sh`` installs). Output paths are checked before anything runs.
Runs stop at ``--eos-id`` only (not at the model's EOS id), so every run decodes the same
number of tokens; ``--max-new-tokens`` must be >= 2 so that each run has a decode rate.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

from dflash.commands.generate import (
    Prepared,
    add_generation_options,
    decoding_failures,
    prefill_chunk,
    prepare,
    report_error,
    usage_errors,
)
from dflash.commands.output import check_output_file
from dflash.commands.settings import cli_message
from dflash.errors import ExecutionError, UsageError
from dflash.execution.errors import ContextLengthError
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
    speedup_vs_greedy: float | None = None  # median tokens/s over greedy_tokens_per_s


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
    greedy_tokens_per_s: float  # median of the plain target-only greedy runs
    greedy_runs: list[float]  # each measured greedy run's tokens/s
    # mode -> median tokens/s (A: mean of A1, A2) over greedy_tokens_per_s; None if incorrect
    speedup_vs_greedy: dict[str, float | None]
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
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help="write the JSON report to this file, and the plot beside it (default: the JSON "
        "report on stdout, no files)",
    )
    p.add_argument(
        "--plot",
        default=None,
        help="PNG plot path (default with --out: the --out path with suffix .png; '' = none)",
    )
    p.add_argument(
        "--json", action="store_true", help="also print the report on stdout when --out is given"
    )
    p.set_defaults(run=run)


def _rate(r: Any) -> float:
    """A run's decode rate; a run without a decode step (EOS from the prefill) has none."""
    rate: float | None = r.timings.tokens_per_s
    if rate is None:
        raise ExecutionError(
            "a run stopped at --eos-id right after the prefill, so it has no decode rate; "
            "choose another --eos-id or prompt"
        )
    return rate


def _phase(name: str, mode: str, results: list[Any], oracle_sha: str) -> Phase:
    runs = [
        RunStats(
            tokens_per_s=_rate(r),
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
        f"{'fwd/eff':>8} {'fast/replay/fail':>17} {'ckpt MiB':>9} {'vs greedy':>9} correct"
    )
    lines = [head, "-" * len(head)]
    for ph in report.phases:
        last = ph.runs[-1]
        eff_value = last.effective_forwards_per_step
        eff = "-" if eff_value is None else f"{eff_value:.2f}"
        vs = "-" if ph.speedup_vs_greedy is None else f"{ph.speedup_vs_greedy:.2f}x"
        lines.append(
            f"{ph.name:<6} {ph.mode:<11} {ph.median_tokens_per_s:>15.2f} "
            f"{ph.target_forwards_per_step:>9.2f} {ph.acceptance_rate:>7.3f} "
            f"{eff:>8} "
            f"{f'{last.fast}/{last.replay}/{last.replay_after_failure}':>17} "
            f"{ph.checkpoint_bytes / 2**20:>9.1f} {vs:>9} {all(r.correct for r in ph.runs)}"
        )
    lines.append(f"A1/A2 drift: {report.drift_a:.1%}")
    plain = "greedy" if report.setup.get("sampling") is None else "sampled"
    lines.append(
        f"plain target-only {plain}: {report.greedy_tokens_per_s:.2f} tok/s "
        f"(median of {len(report.greedy_runs)})"
    )
    for mode, s in report.speedup.items():
        lines.append(
            f"speed-up {mode} vs A: "
            + ("not reported (a run was incorrect)" if s is None else f"{s:.2f}x")
        )
    for mode, s in report.speedup_vs_greedy.items():
        lines.append(
            f"speed-up {mode} vs plain {plain}: "
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


def plot_path(args: argparse.Namespace) -> Path | None:
    """Where the PNG goes: ``--plot``, else beside ``--out``; None for no plot."""
    if args.plot is not None:
        return Path(args.plot) if args.plot else None
    return None if args.out is None else args.out.with_suffix(".png")


def matplotlib_missing() -> bool:
    import importlib.util

    return importlib.util.find_spec("matplotlib") is None


def check_outputs(args: argparse.Namespace) -> Path | None:
    """The output paths, checked before the benchmark runs; returns the plot path."""
    if args.out is not None:
        check_output_file(args.out, "--out", "bench.json")
    png = plot_path(args)
    if png is not None:
        check_output_file(png, "--plot", "bench.png")
        if args.out is not None and png.resolve() == args.out.resolve():
            raise UsageError(f"--plot and --out name the same file ({str(png)!r})")
    return png


def run(args: argparse.Namespace) -> int:
    try:
        png = check_outputs(args)
        if args.max_new_tokens < 2:
            raise UsageError(
                f"--max-new-tokens must be >= 2 for bench (got {args.max_new_tokens}): the "
                "first token comes from the prefill, so a rate needs at least one decode step"
            )
        mode_a = parse_mode(args.a, source="--a")
        modes_b = [parse_mode(m, source="--b") for m in args.b.split(",")]
        if args.runs < 1 or args.warmup < 0:
            raise UsageError(
                f"--runs must be >= 1 and --warmup >= 0 (got {args.runs}, {args.warmup})"
            )
        ready = prepare(args)
    except usage_errors() as exc:
        report_error(args, f"dflash bench: error: {cli_message(exc)}", exc)
        return 2
    except decoding_failures() as exc:
        report_error(args, f"dflash bench: failed: {type(exc).__name__}: {exc}", exc)
        return 3
    if png is not None and matplotlib_missing():
        print(
            "dflash bench: matplotlib is not installed, so no plot will be written "
            "(pip install 'dflash[plot]', or use bash scripts/run.sh, which installs it)",
            file=sys.stderr,
        )
        png = None
    try:
        return _bench(args, ready, mode_a, modes_b, png)
    except ContextLengthError as exc:  # the budget past the model's positions, refused
        report_error(args, f"dflash bench: error: {cli_message(exc)}", exc)  # before decoding
        return 2
    except decoding_failures() as exc:  # a failure while measuring: exit 3, no traceback
        report_error(args, f"dflash bench: failed: {type(exc).__name__}: {exc}", exc)
        return 3


def _bench(
    args: argparse.Namespace,
    ready: Prepared,
    mode_a: RollbackMode,
    modes_b: list[RollbackMode],
    png: Path | None,
) -> int:
    """The A/B/A phases, the report, its table, JSON and plot; returns the exit status."""
    from dflash.commands.harness import Harness
    from dflash.execution.oracle import greedy_target, reference_greedy
    from dflash.execution.policy import RollbackPolicy
    from dflash.execution.results import token_sha256

    model, plan, prompt, drafter = ready.model, ready.plan, ready.prompt, ready.drafter
    dtype, devices, acceptance = ready.dtype, ready.devices, ready.acceptance
    oracle = ready.oracle
    graphs = False if getattr(args, "no_graphs", False) else None
    # one target for every speculative run and one for the greedy baseline, kept across
    # runs: CUDA graphs are captured once (in the warm-up), as a serving process would.
    # The speculative one first: it refuses a budget past the model's positions.
    harness = Harness.kept(
        model, drafter, prompt, plan, max_new_tokens=args.max_new_tokens,
        block_size=args.block_size, eos_id=args.eos_id, graphs=graphs,
        verify_window=args.verify_window, tree_budget=args.tree_budget, sampling=ready.sampling,
        prefill_chunk=prefill_chunk(args), max_context=args.max_context,
    )
    if oracle is None:
        oracle = reference_greedy(model, plan, prompt, args.max_new_tokens, graphs=graphs,
                                  sampling=ready.sampling, prefill_chunk=prefill_chunk(args))
    oracle = oracle[: args.max_new_tokens]
    if args.eos_id is not None and args.eos_id in oracle:  # the runs stop there too
        oracle = oracle[: oracle.index(args.eos_id) + 1]
    oracle_sha = token_sha256(oracle)
    harness = dataclasses.replace(
        harness, greedy_target=greedy_target(model, plan, len(prompt), len(oracle), graphs=graphs,
                                             prefill_chunk=prefill_chunk(args))
    )

    def measure(mode: RollbackMode, name: str) -> Phase:
        policy = RollbackPolicy(mode=mode)
        results = []
        for i in range(args.warmup + args.runs):
            r = harness.speculative(policy)  # a new engine each run: its gate runs each time
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

    def measure_greedy() -> tuple[list[float], bool]:
        """Plain greedy decoding of the runs' tokens: measured rates, all runs correct."""
        rates, ok = [], True
        for i in range(args.warmup + args.runs):
            g = harness.greedy(len(oracle))
            if g.tokens_per_s is None:  # unreachable: A1 already refused an EOS from the prefill
                raise ExecutionError("the greedy baseline has no decode step to time")
            print(
                f"dflash bench: plain greedy run {i + 1}/{args.warmup + args.runs}: "
                f"{g.tokens_per_s:.2f} tok/s",
                file=sys.stderr,
            )
            ok = ok and g.tokens == oracle
            if i >= args.warmup:
                rates.append(g.tokens_per_s)
        return rates, ok

    phases = [measure(mode_a, "A1")]
    phases += [measure(m, f"B{i + 1}") for i, m in enumerate(modes_b)]
    phases.append(measure(mode_a, "A2"))
    greedy_runs, greedy_ok = measure_greedy()
    greedy_rate = statistics.median(greedy_runs)
    # a greedy run that differs from the oracle makes the whole comparison incorrect
    correct = greedy_ok and all(r.correct for p in phases for r in p.runs)
    a1, a2 = phases[0].median_tokens_per_s, phases[-1].median_tokens_per_s
    a_mean = (a1 + a2) / 2

    def vs_greedy(rate: float) -> float | None:
        return rate / greedy_rate if correct and greedy_rate else None

    phases = [
        p.model_copy(update={"speedup_vs_greedy": vs_greedy(p.median_tokens_per_s)})
        for p in phases
    ]
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
            "tree_budget": args.tree_budget,
            "warmup": args.warmup,
            "runs": args.runs,
            # the rule plain decoding and every run draw by (None: greedy)
            "sampling": None if ready.sampling.greedy else dataclasses.asdict(ready.sampling),
        },
        oracle_sha256=oracle_sha,
        phases=phases,
        correct=correct,
        drift_a=abs(a1 - a2) / a_mean if a_mean else 0.0,
        speedup={
            p.mode: (p.median_tokens_per_s / a_mean if correct and a_mean else None)
            for p in phases[1:-1]
        },
        greedy_tokens_per_s=greedy_rate,
        greedy_runs=greedy_runs,
        speedup_vs_greedy={
            mode_a: vs_greedy(a_mean),
            **{p.mode: vs_greedy(p.median_tokens_per_s) for p in phases[1:-1]},
        },
        note=(
            "synthetic drafter: acceptance chosen by configuration, not measured"
            if args.draft == "synthetic"
            else f"drafter {args.draft}"
        ),
    )
    print(table(report), file=sys.stderr)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report.model_dump(), indent=2) + "\n")
        print(f"dflash bench: report written to {str(args.out)!r}", file=sys.stderr)
    if png is not None:
        message = plot(report, str(png))
        print(f"dflash bench: {message or f'plot written to {str(png)!r}'}", file=sys.stderr)
    if args.json or args.out is None:
        sys.stdout.write(report.model_dump_json() + "\n")
    return 0 if correct else 1
