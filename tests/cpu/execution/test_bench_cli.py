"""``dflash bench``: A/B/A phases, medians, drift, the correctness gate, JSON and plot."""

from __future__ import annotations

import builtins
import json
from pathlib import Path
from typing import Any

import pytest

from dflash.cli import main
from dflash.execution import reference_greedy

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


def test_aba_report(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import dflash.execution.run as run_module

    greedy_calls: list[object] = []  # timed plain-greedy decodes (the oracle comes from
    real_greedy = reference_greedy  # the synthetic drafter, not counted here)

    def counting(*args: Any, **kwargs: Any) -> list[int]:
        greedy_calls.append(kwargs["graphs"])
        return real_greedy(*args, **kwargs)

    monkeypatch.setattr(run_module, "reference_greedy", counting)
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
    # plain greedy: the same warm-up and runs as each phase, graphs as in the B runs
    assert greedy_calls == [None, None]
    greedy = report["greedy_tokens_per_s"]
    assert len(report["greedy_runs"]) == 2 and all(r > 0 for r in report["greedy_runs"])
    assert greedy == pytest.approx(sum(report["greedy_runs"]) / 2)
    for phase in report["phases"]:
        assert phase["speedup_vs_greedy"] == phase["median_tokens_per_s"] / greedy
    assert report["speedup_vs_greedy"] == {"replay": a_mean / greedy, "remap": m_b1 / greedy}
    assert "vs greedy" in err and f"{m_b1 / greedy:.2f}x" in err
    assert f"plain target-only greedy: {greedy:.2f} tok/s (median of 2)" in err
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
    err = capsys.readouterr().err
    assert "--b must be one of replay, checkpoint, remap, recompute (got 'fast')" in err


def test_a_wrong_greedy_run_withholds_the_speedups(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import dflash.execution.run as run_module

    real_greedy = reference_greedy

    def wrong_last_token(*args: Any, **kwargs: Any) -> list[int]:
        tokens = real_greedy(*args, **kwargs)
        return [*tokens[:-1], tokens[-1] + 1]

    monkeypatch.setattr(run_module, "reference_greedy", wrong_last_token)
    assert main([*ARGS, "--runs", "1", "--warmup", "1", "--b", "remap"]) == 1
    stdout, err = capsys.readouterr()
    report = json.loads(stdout)
    assert len(report["greedy_runs"]) == 1  # the warm-up run is not measured
    assert report["correct"] is False
    assert report["speedup_vs_greedy"] == {"replay": None, "remap": None}
    assert all(p["speedup_vs_greedy"] is None for p in report["phases"])
    assert "speed-up remap vs plain greedy: not reported (a run was incorrect)" in err
