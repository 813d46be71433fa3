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
    a1, b1, a2 = report["phases"]
    assert a1["target_forwards_per_step"] == 2.0
    assert b1["target_forwards_per_step"] < 2.0 and b1["capture_verdict"] == "validated"
    for phase in report["phases"]:  # two runs each: the median is their mean
        runs = [r["tokens_per_s"] for r in phase["runs"]]
        assert all(r > 0 for r in runs), phase["name"]
        assert phase["median_tokens_per_s"] == pytest.approx(sum(runs) / 2), phase["name"]
    # speed-up and drift follow from the run's own medians (timings vary, relations do not)
    m_a1, m_b1, m_a2 = (p["median_tokens_per_s"] for p in (a1, b1, a2))
    a_mean = (m_a1 + m_a2) / 2
    assert report["speedup"] == {"remap": pytest.approx(m_b1 / a_mean, rel=1e-12)}
    assert report["drift_a"] == pytest.approx(abs(m_a1 - m_a2) / a_mean, rel=1e-12, abs=1e-15)
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
