"""``dflash bench``: A/B/A phases, medians, drift, the correctness gate, JSON and plot."""

from __future__ import annotations

import builtins
import json
from pathlib import Path
from typing import Any

import pytest

from dflash.cli import main

ARGS = [
    "bench",
    "--devices",
    "cpu",
    "--max-new-tokens",
    "6",
    "--block-size",
    "4",
    "--draft",
    "synthetic",
    "--acceptance",
    "0.7",
    "--prompt-len",
    "5",
    "--runs",
    "2",
    "--warmup",
    "0",
]


def test_aba_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    code = main(
        [*ARGS, "--a", "replay", "--b", "remap", "--out", str(out), "--plot", str(png), "--json"]
    )
    stdout, err = capsys.readouterr()
    assert code == 0, err
    report = json.loads(out.read_text())
    assert json.loads(stdout) == report
    assert [p["name"] for p in report["phases"]] == ["A1", "B1", "A2"]
    assert [p["mode"] for p in report["phases"]] == ["replay", "remap", "replay"]
    assert all(len(p["runs"]) == 2 for p in report["phases"])
    assert report["correct"] is True
    assert report["speedup"]["remap"] is not None and report["speedup"]["remap"] > 0
    a1, b1, _ = report["phases"]
    assert a1["target_forwards_per_step"] == 2.0
    assert b1["target_forwards_per_step"] < 2.0 and b1["capture_verdict"] == "validated"
    runs = sorted(r["tokens_per_s"] for r in a1["runs"])
    assert a1["median_tokens_per_s"] == pytest.approx(sum(runs) / 2)
    assert report["drift_a"] >= 0.0
    assert "synthetic" in report["note"]
    assert png.exists() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "A1/A2 drift" in err


def test_missing_matplotlib_is_a_clear_message(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    real_import = builtins.__import__

    def no_matplotlib(name: str, *args: Any, **kwargs: Any) -> Any:
        if name.startswith("matplotlib"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    png = tmp_path / "bench.png"
    code = main(
        [
            *ARGS,
            "--runs",
            "1",
            "--b",
            "checkpoint",
            "--out",
            str(tmp_path / "b.json"),
            "--plot",
            str(png),
        ]
    )
    assert code == 0
    assert "matplotlib is not installed" in capsys.readouterr().err
    assert not png.exists()


def test_bad_mode_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*ARGS, "--b", "checkpoint,fast"]) == 2
    assert "--b must be one of replay, checkpoint, remap (got 'fast')" in capsys.readouterr().err
