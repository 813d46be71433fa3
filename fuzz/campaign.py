"""The fuzz campaign runner: ``python -m fuzz --seconds N [--runs N] [--engine atheris|
hypothesis] [--report PATH] [--corpus DIR] [--crashes DIR]``.

Runs one engine against :mod:`fuzz.oracle`, then replays the corpus it built (plus the
committed seeds) under a line tracer to measure the line coverage of ``dflash/geometry``,
and writes a JSON report: executions, verdicts reached per policy, reject reasons never
reached, crashes (each with its reproducer file) and coverage. Exits 1 if any crash was
found, 2 if the engine could not run, 0 otherwise.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from fuzz.coverage_trace import GEOMETRY_DIR, geometry_line_coverage
from fuzz.stats import Recorder

HERE = Path(__file__).resolve().parent
SEEDS = HERE / "seeds"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m fuzz", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return parser.parse_args(argv)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seconds", type=float, required=True, help="time budget")
    parser.add_argument("--runs", type=int, default=0, help="stop after this many executions")
    parser.add_argument("--engine", choices=("atheris", "hypothesis"), default="atheris")
    parser.add_argument("--report", type=Path, default=Path("fuzz-report.json"))
    parser.add_argument("--corpus", type=Path, default=None,
                        help="corpus directory (kept and grown; default: a fresh temporary one)")
    parser.add_argument("--crashes", type=Path, default=HERE / "crashes",
                        help="where crash reproducers are written")
    parser.add_argument("--seed", type=int, default=0, help="hypothesis engine: random seed")


def run_atheris(args: argparse.Namespace, corpus: Path, stats_path: Path) -> dict[str, Any]:
    log = stats_path.with_suffix(".log")
    cmd = [sys.executable, "-m", "fuzz.atheris_harness", "--seconds", str(args.seconds),
           "--runs", str(args.runs), "--stats", str(stats_path), "--crashes", str(args.crashes),
           str(corpus), str(SEEDS)]
    with log.open("wb") as out:
        proc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=HERE.parent,
                              env={**os.environ, "PYTHONPATH": str(HERE.parent)}, check=False)
    if not stats_path.exists():
        tail = log.read_text(errors="replace")[-2000:]
        raise RuntimeError(f"atheris harness exited {proc.returncode} without stats:\n{tail}")
    stats: dict[str, Any] = json.loads(stats_path.read_text())
    stats["engine_exit_code"] = proc.returncode
    return stats


def run_hypothesis(args: argparse.Namespace) -> dict[str, Any]:
    from fuzz.hypothesis_harness import fuzz_for

    recorder = Recorder(args.crashes)
    fuzz_for(recorder, args.seconds, args.runs, args.seed)
    return recorder.snapshot()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.crashes = args.crashes.resolve()
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    with tempfile.TemporaryDirectory(prefix="dflash-fuzz-") as tmp:
        corpus = (args.corpus or Path(tmp) / "corpus").resolve()
        corpus.mkdir(parents=True, exist_ok=True)
        try:
            if args.engine == "atheris":
                stats = run_atheris(args, corpus, Path(tmp) / "stats.json")
            else:
                stats = run_hypothesis(args)
        except Exception as err:
            print(f"dflash fuzz: the {args.engine} engine failed: {err}", file=sys.stderr)
            return 2
        replay = sorted(p for d in (corpus, SEEDS) for p in d.iterdir() if p.is_file())
        coverage = geometry_line_coverage([p.read_bytes() for p in replay])
        corpus_size = sum(1 for p in corpus.iterdir() if p.is_file())
    report = build_report(args, stats, coverage, corpus_size, started)
    args.report.parent.mkdir(parents=True, exist_ok=True)
    args.report.write_text(json.dumps(report, indent=2) + "\n")
    print(summary(report), file=sys.stderr)
    return 1 if report["crashes"] else 0


def build_report(args: argparse.Namespace, stats: dict[str, Any], coverage: dict[str, Any],
                 corpus_size: int, started: str) -> dict[str, Any]:
    from dflash.geometry import RejectReason

    reasons: dict[str, int] = stats["reasons"]
    reached = {key.split(":", 1)[1] for key in reasons}
    return {
        "engine": args.engine,
        "started_utc": started,
        "seconds_budget": args.seconds,
        "runs_budget": args.runs or None,
        "seconds": stats["seconds"],
        "executions": stats["executions"],
        "executions_per_second": round(stats["executions"] / max(stats["seconds"], 1e-9)),
        "verdicts": reasons,
        "reject_reasons_reached": sorted(r.value for r in RejectReason if r.value in reached),
        "reject_reasons_not_reached": sorted(
            r.value for r in RejectReason if r.value not in reached),
        "crashes": stats["crashes"],
        "corpus_size": corpus_size,
        "coverage": coverage,
        "python": platform.python_version(),
        "geometry_source_sha256": geometry_source_digest(),
    }


def geometry_source_digest() -> str:
    """SHA-256 over dflash/geometry/*.py (name and bytes), identifying the code fuzzed."""
    digest = hashlib.sha256()
    for path in sorted(GEOMETRY_DIR.glob("*.py")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def summary(report: dict[str, Any]) -> str:
    cov = report["coverage"]
    reached = len(report["reject_reasons_reached"])
    total = reached + len(report["reject_reasons_not_reached"])
    return (f"fuzz ({report['engine']}): {report['executions']} executions in "
            f"{report['seconds']:.1f} s, {len(report['crashes'])} crashes, reject reasons reached "
            f"{reached}/{total}, dflash/geometry line coverage "
            f"{cov['covered_lines']}/{cov['executable_lines']} ({cov['percent']}%)")


if __name__ == "__main__":
    sys.exit(main())
