"""Mutation testing in CI: a fixed subset of 20 mutants of the geometry validator must be
killed by the fast geometry tests (the full run is ``python -m mutation``; its score is
recorded in specs/geometry.md and specs/rollback.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from mutation.operators import mutants
from mutation.runner import equivalent_ids, identity, sample

ROOT = Path(__file__).resolve().parents[2]
SUBSET = ("dflash/geometry/rules.py", "dflash/geometry/validate.py")


def test_operators_make_each_kind_of_mutant() -> None:
    source = (
        '"""doc"""\n'
        "def f(x: int, ok: bool) -> int:\n"
        '    """doc"""\n'
        "    y = x + 1\n"
        "    if x < 2 and ok:\n"
        "        raise ValueError(f'bad {x}')\n"
        "    return y if not ok else 0\n"
    )
    found = {(m.operator, m.description) for m in mutants(source, "m.py")}
    assert found == {
        ("delete", "Assign statement deleted"), ("arith", "Add -> Sub"),
        ("const", "1 -> 2"), ("const", "1 -> 0"), ("negate", "test negated"),
        ("and_or", "And -> Or"), ("cmp_flip", "Lt -> GtE"), ("cmp_boundary", "Lt -> LtE"),
        ("const", "2 -> 3"), ("const", "2 -> 1"), ("delete", "Raise statement deleted"),
        ("return_none", "return value -> None"), ("negate", "'not' removed"),
        ("const", "0 -> 1"), ("const", "0 -> -1"),
    }  # docstrings, annotations and the f-string message are never mutated
    first = mutants(source, "m.py")
    assert [m.id for m in first] == [m.id for m in mutants(source, "m.py")]  # fixed order
    assert all(m.source != identity_source(source) for m in first)


def identity_source(source: str) -> str:
    import ast

    return ast.unparse(ast.parse(source))


def test_subset_selection_is_fixed_and_the_identity_compiles() -> None:
    pool = [m for path in SUBSET for m in mutants((ROOT / path).read_text(), path)]
    chosen = sample(pool, 20)
    assert len({m.id for m in chosen}) == 20 and chosen == sample(list(reversed(pool)), 20)
    for path in SUBSET:
        compile(identity(path).source, path, "exec")
    assert equivalent_ids("- `a.py:1:2:const:0` x\n  - `no`\n- `b.py:3:4:delete:0`") == {
        "a.py:1:2:const:0", "b.py:3:4:delete:0"}


def test_fixed_subset_of_mutants_is_killed(tmp_path: Path) -> None:
    report = tmp_path / "mutation.json"
    args = [sys.executable, "-m", "mutation", "--quick", "--sample", "20", "--timeout", "60",
            "--report", str(report)]
    for path in SUBSET:
        args += ["--only", path]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
                          check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads(report.read_text())["summary"]
    assert summary["mutants"] == 20 and summary["survived"] == 0
    assert summary["killed"] + summary["equivalent"] == 20
