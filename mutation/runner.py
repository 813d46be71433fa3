"""Run every mutant of the guard core against a fixed, targeted set of fast tests.

``python -m mutation [--only PATH] [--sample K] [--report FILE] [--timeout S]``

Each mutant runs in a forked child of one parent process that has imported the heavy
dependencies (torch, numpy, hypothesis, z3, pydantic, pytest) but no ``dflash`` module;
in the child an import hook serves the mutated source for the one mutated module, then
``pytest -x`` runs that module's fixed test list (fast tests first). A mutant is
*killed* when the tests fail or error, *survived* when they pass, *timeout* (counted as
killed) when they run past ``--timeout``. Hypothesis runs derandomised without a database
so every run selects the same examples. The unmutated code must pass first.

The mutants listed in ``mutation/equivalent.md`` (by id) are equivalent to the original
program, with the argument written there; the score is ``killed / (mutants - equivalent)``.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.abc
import importlib.util
import json
import os
import re
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

from mutation.operators import Mutant, mutants

ROOT = Path(__file__).resolve().parents[1]
GEOMETRY_TESTS = (
    "tests/cpu/geometry/test_reference_cases.py",
    "tests/cpu/geometry/test_exhaustive_equivalence.py::test_validator_matches_spec_small_bound",
    "tests/cpu/geometry/test_hostile_inputs.py",
    "tests/cpu/geometry/test_mutant_kills.py",
    "tests/cpu/geometry/test_properties.py",
    "tests/cpu/geometry/test_fuzz_harness.py",
    "tests/cpu/geometry/test_symbolic_proof.py",
)
GATE_TESTS = (
    "tests/cpu/execution/test_gate_mutants.py",
    "tests/cpu/execution/test_capture_gate.py",
)
POLICY_TESTS = (
    "tests/cpu/execution/test_policy_mutants.py",
    "tests/cpu/execution/test_values.py",
)
#: module file -> the fixed tests its mutants run against (in this order, stopping at the
#: first failure)
TARGETS: dict[str, tuple[str, ...]] = {
    "dflash/geometry/rules.py": GEOMETRY_TESTS,
    "dflash/geometry/validate.py": GEOMETRY_TESTS,
    "dflash/geometry/inputs.py": GEOMETRY_TESTS,
    "dflash/geometry/values.py": GEOMETRY_TESTS,
    "dflash/geometry/reasons.py": GEOMETRY_TESTS,
    "dflash/execution/capture_gate.py": GATE_TESTS,
    "dflash/execution/policy.py": POLICY_TESTS,
}
#: ``--quick``: the first, fastest tests of each list (the CI subset runs these)
QUICK: dict[str, tuple[str, ...]] = {
    path: (GEOMETRY_TESTS[0], GEOMETRY_TESTS[2], GEOMETRY_TESTS[3], GEOMETRY_TESTS[1])
    if path.startswith("dflash/geometry") else tests[:1]
    for path, tests in TARGETS.items()
}
PRELOAD = ("torch", "numpy", "hypothesis", "z3", "pydantic", "pytest")
EQUIVALENT_FILE = ROOT / "mutation" / "equivalent.md"


def module_name(path: str) -> str:
    return path.removesuffix(".py").replace("/", ".")


class _MutantLoader(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves ``source`` as the module ``name`` (everything else imports normally)."""

    def __init__(self, name: str, path: str, source: str) -> None:
        self.name, self.path, self.source = name, path, source

    def find_spec(self, fullname: str, path: Sequence[str] | None = None,
                  target: ModuleType | None = None) -> Any:
        if fullname != self.name:
            return None
        return importlib.util.spec_from_file_location(fullname, self.path, loader=self)

    def create_module(self, spec: Any) -> None:
        return None

    def exec_module(self, module: ModuleType) -> None:
        code = compile(self.source, self.path, "exec")
        exec(code, module.__dict__)  # the mutant is the code under test


def _child(mutant: Mutant | None, path: str, tests: Sequence[str]) -> int:
    """In the forked child: install the mutant, run the tests, return pytest's code."""
    if mutant is not None:
        sys.meta_path.insert(0, _MutantLoader(module_name(path), str(ROOT / path), mutant.source))
    from hypothesis import settings

    settings.register_profile("mutation", database=None, derandomize=True, print_blob=False)
    settings.load_profile("mutation")
    import pytest

    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)
    return int(pytest.main([*tests, "-x", "-q", "-p", "no:cacheprovider", "--no-header",
                            "-p", "no:randomly", "-W", "ignore"]))


def run_one(mutant: Mutant | None, path: str, timeout: float,
            quick: bool = False) -> tuple[str, float]:
    """("killed" | "survived" | "timeout", seconds) for one mutant (None: the original)."""
    tests = (QUICK if quick else TARGETS)[path]
    start = time.perf_counter()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the child never returns into the runner
        code = 3
        try:
            os.chdir(ROOT)
            code = _child(mutant, path, tests)
        finally:
            os._exit(code)
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.perf_counter() - start > timeout:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return "timeout", time.perf_counter() - start
        time.sleep(0.02)
    elapsed = time.perf_counter() - start
    code = os.waitstatus_to_exitcode(status)
    if code == 0:
        return "survived", elapsed
    if code in (4, 5) and (mutant is None or mutant.operator == "identity"):
        raise RuntimeError(f"pytest exit {code} for {path} ({tests}): check the test list")
    # 1: tests failed; 2/3: collection or internal error; 4/5: a test module the mutant
    # broke at import time (its node ids are then "not found"); the identity run above
    # shows the list itself is valid
    return "killed", elapsed


def equivalent_ids(text: str | None = None) -> set[str]:
    """Mutant ids named (in backticks, at the start of a list item) in equivalent.md."""
    if text is None:
        text = EQUIVALENT_FILE.read_text() if EQUIVALENT_FILE.exists() else ""
    return set(re.findall(r"^- `([^`]+)`", text, flags=re.MULTILINE))


def identity(path: str) -> Mutant:
    """The module itself, round-tripped through the AST like every mutant."""
    import ast

    source = ast.unparse(ast.parse((ROOT / path).read_text()))
    return Mutant(path, 0, 0, "identity", 0, "no change", source)


def all_mutants(paths: Sequence[str]) -> list[Mutant]:
    out: list[Mutant] = []
    for path in paths:
        out += mutants((ROOT / path).read_text(), path)
    return out


def sample(items: list[Mutant], k: int) -> list[Mutant]:
    """A deterministic selection of ``k`` mutants: the smallest sha256 of their ids."""
    return sorted(items, key=lambda m: hashlib.sha256(m.id.encode()).hexdigest())[:k]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mutation", description=__doc__)
    parser.add_argument("--only", action="append", choices=sorted(TARGETS),
                        help="mutate only this file (repeatable)")
    parser.add_argument("--sample", type=int, default=0, help="run only K mutants (fixed set)")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per mutant")
    parser.add_argument("--report", type=Path, help="write a JSON report here")
    parser.add_argument("--id", action="append", help="run only the mutant with this id")
    parser.add_argument("--quick", action="store_true",
                        help="run only the first, fastest tests of each list (CI subset)")
    args = parser.parse_args(argv)
    paths = args.only or list(TARGETS)
    for name in PRELOAD:
        __import__(name)
    for path in sorted(set(paths)):  # the unmutated module, served through the same hook
        state, seconds = run_one(identity(path), path, args.timeout * 4, args.quick)
        if state != "survived":
            print(f"the unmutated tests for {path} do not pass ({state}); fix them first")
            return 2
    chosen = all_mutants(paths)
    if args.id:
        chosen = [m for m in chosen if m.id in set(args.id)]
    if args.sample:
        chosen = sample(chosen, args.sample)
    equivalent = equivalent_ids()
    results: list[dict[str, Any]] = []
    start = time.perf_counter()
    for i, mutant in enumerate(chosen, 1):
        state, seconds = run_one(mutant, mutant.path, args.timeout, args.quick)
        if state == "survived" and mutant.id in equivalent:
            state = "equivalent"
        results.append({"id": mutant.id, "operator": mutant.operator,
                        "description": mutant.description, "state": state,
                        "seconds": round(seconds, 2)})
        if state == "survived":
            print(f"SURVIVED {mutant.id} ({mutant.description})", flush=True)
        if i % 25 == 0:
            print(f"[{i}/{len(chosen)}] {time.perf_counter() - start:.0f} s", flush=True)
    summary = summarize(results)
    print(json.dumps(summary, indent=1))
    if args.report:
        args.report.write_text(json.dumps({"summary": summary, "mutants": results}, indent=1))
    return 0 if summary["survived"] == 0 else 1


def summarize(results: list[dict[str, Any]]) -> dict[str, Any]:
    by_file: dict[str, dict[str, int]] = {}
    for r in results:
        counts = by_file.setdefault(r["id"].split(":")[0], {})
        counts[r["state"]] = counts.get(r["state"], 0) + 1
    total = len(results)
    killed = sum(r["state"] in ("killed", "timeout") for r in results)
    equivalent = sum(r["state"] == "equivalent" for r in results)
    survived = sum(r["state"] == "survived" for r in results)
    score = killed / (total - equivalent) if total > equivalent else 1.0
    return {"mutants": total, "killed": killed, "equivalent": equivalent,
            "survived": survived, "score": round(score, 4), "by_file": by_file}


if __name__ == "__main__":
    sys.exit(main())
