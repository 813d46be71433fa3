"""Line coverage of ``dflash/geometry`` by replaying fuzz inputs under ``sys.settrace``.

No third-party coverage tool is needed: executable lines are read from the compiled code
objects of each module (``co_lines``), executed lines are recorded by a tracer that only
follows frames whose code lives in ``dflash/geometry``.
"""

from __future__ import annotations

import contextlib
import inspect
import sys
import types
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import dflash.geometry
from fuzz.oracle import check_one

GEOMETRY_DIR = Path(dflash.geometry.__file__).resolve().parent


def executable_lines(path: Path) -> set[int]:
    code = compile(path.read_text(), str(path), "exec")
    lines: set[int] = set()
    stack = [code]
    while stack:
        co = stack.pop()
        lines.update(line for _, _, line in co.co_lines() if line is not None)
        stack.extend(c for c in co.co_consts if isinstance(c, types.CodeType))
    return lines


def geometry_line_coverage(inputs: Sequence[bytes]) -> dict[str, Any]:
    """Replay ``inputs`` through the oracle; lines of dflash/geometry executed / executable.

    Module-level lines (imports, class bodies, ``def`` statements) ran at import time,
    before tracing started, so they are counted as covered."""
    files = sorted(GEOMETRY_DIR.glob("*.py"))
    executed: dict[str, set[int]] = {str(p): set() for p in files}

    def tracer(frame: types.FrameType, event: str, arg: object) -> Any:
        filename = frame.f_code.co_filename
        if filename not in executed:
            return None
        lines = executed[filename]

        def local(frame: types.FrameType, event: str, arg: object) -> Any:
            if event == "line":
                lines.add(frame.f_lineno)
            return local

        lines.add(frame.f_lineno)
        return local

    old = sys.gettrace()
    sys.settrace(tracer)
    try:
        for data in inputs:
            with contextlib.suppress(Exception):  # crashes are the engine's to report
                check_one(data)
    finally:
        sys.settrace(old)
    per_file: dict[str, Any] = {}
    total = covered = 0
    for path in files:
        code_lines = executable_lines(path)
        module_level = _import_time_lines(path)
        hit = (executed[str(path)] | module_level) & code_lines
        missing = sorted(code_lines - hit)
        per_file[path.name] = {"executable": len(code_lines), "covered": len(hit),
                               "missing_lines": missing}
        total += len(code_lines)
        covered += len(hit)
    return {"scope": "dflash/geometry/*.py", "method": "sys.settrace replay of the corpus",
            "executable_lines": total, "covered_lines": covered,
            "percent": round(100.0 * covered / max(total, 1), 1), "files": per_file,
            "inputs_replayed": len(inputs)}


def _import_time_lines(path: Path) -> set[int]:
    """Lines of the module body and class bodies: they run when the module is imported."""
    lines: set[int] = set()
    stack = [compile(path.read_text(), str(path), "exec")]
    while stack:
        co = stack.pop()
        lines.update(line for _, _, line in co.co_lines() if line is not None)
        stack.extend(c for c in co.co_consts if isinstance(c, types.CodeType)
                     and not c.co_flags & inspect.CO_NEWLOCALS)
    return lines
