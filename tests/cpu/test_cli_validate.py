"""``dflash validate`` and ``dflash fuzz`` as a user runs them: exit codes, output, JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def dflash(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "dflash.cli", *args], input=stdin,
                          capture_output=True, text=True, cwd=ROOT, timeout=120, check=False)


def test_example_chain_is_accepted() -> None:
    proc = dflash("validate", str(ROOT / "examples" / "draft_chain.json"))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("accepted: chain of 8 slots")


@pytest.mark.parametrize(("document", "tree", "code", "reason", "slot"), [
    ('{"parents": [-1, 0, 1, 2], "n_actual": 4}', False, 0, None, None),
    ("[-1, 0, 0, 2]", False, 1, "sibling", 2),
    ("[-1, 0, 0, 2]", True, 0, None, None),
    ('{"parents": [-1, 0, 7], "n_actual": 3}', False, 1, "out_of_range", 2),
    ('{"parents": [-1, 0], "n_actual": 3}', False, 1, "truncated", None),
    ('{"parents": null, "n_actual": 1}', False, 1, "null", None),
    ('{"parents": [-1, 1.0]}', True, 1, "not_integer", 1),
    ('{"parents": [-1, 0, 1, 99], "n_actual": 3}', False, 0, None, None),
])
def test_verdict_json_and_exit_code(document: str, tree: bool, code: int, reason: str | None,
                                    slot: int | None) -> None:
    proc = dflash("validate", "--json", *(["--tree"] if tree else []), stdin=document)
    assert proc.returncode == code, proc.stderr
    lines = proc.stdout.splitlines()
    assert len(lines) == 1  # one JSON object, nothing else on stdout
    verdict = json.loads(lines[0])
    assert verdict["accepted"] is (code == 0)
    if code == 0:
        assert verdict["kind"] == ("tree" if tree else "chain")
    else:
        assert (verdict["reason"], verdict["slot"]) == (reason, slot)
        assert verdict["message"]


def test_human_output_names_reason_slot_and_message() -> None:
    proc = dflash("validate", "-", stdin="[0, 0, 1]")
    assert proc.returncode == 1
    assert "rejected: malformed_root at slot 0" in proc.stdout
    assert "'parents' slot 0 is the root and must be -1 (got 0)" in proc.stdout


@pytest.mark.parametrize(("document", "needle"), [
    ("{not json", "not valid JSON"),
    ('"just a string"', "expected a JSON list"),
    ('{"n_actual": 3}', "'parents' key"),
    ('{"parents": [-1], "extra": 1}', "unknown keys"),
    ("[-1, NaN]", "NaN is not a JSON value"),
    ('{"parents": [-1, Infinity]}', "Infinity is not a JSON value"),
    ("[" * 100_000 + "]" * 100_000, "nests its JSON deeper than this reader follows"),
])
def test_unusable_input_exits_2_without_traceback(document: str, needle: str) -> None:
    proc = dflash("validate", "--json", stdin=document)
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert needle in proc.stderr and "Traceback" not in proc.stderr


def test_missing_file_exits_2(tmp_path: Path) -> None:
    proc = dflash("validate", str(tmp_path / "absent.json"))
    assert proc.returncode == 2
    assert "cannot read" in proc.stderr and "Traceback" not in proc.stderr


def test_fuzz_command_writes_its_report(tmp_path: Path) -> None:
    report = tmp_path / "report.json"
    proc = dflash("fuzz", "--seconds", "3", "--engine", "hypothesis", "--report", str(report),
                  "--crashes", str(tmp_path / "crashes"))
    assert proc.returncode == 0, proc.stderr
    data = json.loads(report.read_text())
    assert data["executions"] > 0 and data["crashes"] == []
    assert data["coverage"]["covered_lines"] > 0
    assert set(data["reject_reasons_reached"]) | set(data["reject_reasons_not_reached"]) == {
        "null", "too_large", "truncated", "not_integer", "malformed_root", "out_of_range",
        "cyclic", "skipped_parent", "sibling"}
