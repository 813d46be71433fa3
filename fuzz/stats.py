"""What a fuzz engine records while it runs: executions, verdicts reached, crashes."""

from __future__ import annotations

import hashlib
import json
import time
import traceback
from collections import Counter
from pathlib import Path
from typing import Any

from fuzz.oracle import check_one


class Recorder:
    """Runs the oracle on each input, counting verdicts and writing crash reproducers.

    A crash (oracle mismatch or any exception) is written to ``crashes/<sha1>.bin`` (the
    input) and ``crashes/<sha1>.txt`` (the traceback); fuzzing continues.
    """

    def __init__(self, crashes: Path, stats_path: Path | None = None) -> None:
        self.crashes_dir = crashes
        self.stats_path = stats_path
        self.executions = 0
        self.reasons: Counter[str] = Counter()
        self.crashes: dict[str, str] = {}  # sha1 -> first line of the error
        self.started = time.monotonic()
        self._last_flush = self.started

    def run(self, data: bytes) -> None:
        self.executions += 1
        try:
            chain, tree = check_one(data)
        except BaseException as err:  # every exception is a finding, including SystemExit
            if isinstance(err, KeyboardInterrupt):
                raise
            self._crash(data, err)
        else:
            self.reasons["chain:" + chain] += 1
            self.reasons["tree:" + tree] += 1
        if self.stats_path is not None and self.executions % 4096 == 0:
            now = time.monotonic()
            if now - self._last_flush > 2.0:
                self.flush()
                self._last_flush = now

    def _crash(self, data: bytes, err: BaseException) -> None:
        digest = hashlib.sha1(data).hexdigest()
        if digest in self.crashes:
            return
        self.crashes[digest] = f"{type(err).__name__}: {err}"[:500]
        self.crashes_dir.mkdir(parents=True, exist_ok=True)
        (self.crashes_dir / f"{digest}.bin").write_bytes(data)
        (self.crashes_dir / f"{digest}.txt").write_text(
            "".join(traceback.format_exception(err)) + f"\ninput: {data!r}\n")

    def snapshot(self) -> dict[str, Any]:
        return {
            "executions": self.executions,
            "seconds": round(time.monotonic() - self.started, 3),
            "reasons": dict(sorted(self.reasons.items())),
            "crashes": [{"sha1": k, "error": v, "reproducer": str(self.crashes_dir / f"{k}.bin")}
                        for k, v in sorted(self.crashes.items())],
        }

    def flush(self) -> None:
        if self.stats_path is not None:
            tmp = self.stats_path.with_suffix(".tmp")
            tmp.write_text(json.dumps(self.snapshot()))
            tmp.replace(self.stats_path)
