"""Atheris (libFuzzer) harness: ``python -m fuzz.atheris_harness --seconds N --stats F
--crashes DIR [--runs N] CORPUS_DIR [SEED_DIR ...]``.

Runs in its own process (libFuzzer never returns). The scan and the validators are
instrumented for coverage feedback; the oracle and the specification are not (speed). Stats are
flushed to ``--stats`` every few seconds and once at the end, when the process leaves
with ``os._exit``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import atheris

# Coverage feedback from the scan and the validator entry points, where the verdicts are
# decided; instrumenting every module halves the execution rate for little extra signal.
with atheris.instrument_imports(include=["dflash.geometry.rules", "dflash.geometry.validate"]):
    import dflash.geometry  # noqa: F401  (imported here so that it is instrumented)
from fuzz.stats import Recorder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds", type=float, required=True)
    parser.add_argument("--runs", type=int, default=0, help="stop after this many executions")
    parser.add_argument("--stats", type=Path, required=True)
    parser.add_argument("--crashes", type=Path, required=True)
    parser.add_argument("corpus", nargs="+", type=Path)
    args = parser.parse_args()
    args.crashes.mkdir(parents=True, exist_ok=True)
    recorder = Recorder(args.crashes, args.stats)
    deadline = time.monotonic() + args.seconds

    def finish(code: int) -> None:
        recorder.flush()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)

    def one_input(data: bytes) -> None:
        recorder.run(data)
        if (args.runs and recorder.executions >= args.runs) or (
                recorder.executions % 256 == 0 and time.monotonic() > deadline):
            finish(1 if recorder.crashes else 0)

    # inputs up to 96 bytes: at most 23 slots, past the symbolic proof's bound; longer
    # inputs slow every execution (the spec's look-ahead is quadratic) for no new paths
    flags = [sys.argv[0], *map(str, args.corpus), "-max_len=96", "-print_final_stats=1",
             f"-artifact_prefix={args.crashes}/", "-timeout=10", "-rss_limit_mb=4096"]
    atheris.Setup(flags, one_input)
    atheris.Fuzz()
    finish(1 if recorder.crashes else 0)  # pragma: no cover - Fuzz() does not return


if __name__ == "__main__":
    main()
