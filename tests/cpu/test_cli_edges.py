"""The command line's rough edges: help text, exits, option ranges, output paths, memory."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from dflash.cli import main

ROOT = Path(__file__).resolve().parents[2]
FAST = [  # the seeded tiny model (the default model is the embedded trained pair)
    "--model", "tiny", "--max-new-tokens", "6", "--block-size", "4", "--devices", "cpu",
    "--no-progress",
]
BENCH = [
    "bench",
    "--devices",
    "cpu",
    "--max-new-tokens",
    "4",
    "--block-size",
    "4",
    "--draft",
    "synthetic",
    "--acceptance",
    "0.7",
    "--prompt-len",
    "4",
    "--runs",
    "1",
    "--warmup",
    "0",
    "--b",
    "checkpoint",
]


def dflash(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "dflash.cli", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
        check=False,
    )


# -- help ---------------------------------------------------------------------------------


@pytest.mark.parametrize("command", [[], ["generate"], ["bench"], ["validate"], ["fuzz"]])
def test_help_is_plain_text(command: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main([*command, "--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    assert "usage: dflash" in text
    assert "``" not in text and ":mod:" not in text and ":class:" not in text


# -- quiet exits ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args",
    [
        ["generate", "--json", *FAST],
        ["validate", "--json", "examples/draft_chain.json"],
        ["validate", "examples/draft_chain.json"],
    ],
)
def test_closed_stdout_is_a_quiet_exit(args: list[str]) -> None:
    import os

    # stdout: a pipe whose reader has gone (as in `dflash ... | true` once `true` exited)
    read, write = os.pipe()
    os.close(read)
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "dflash.cli", *args],
            stdout=write,
            stderr=subprocess.PIPE,
            text=True,
            cwd=ROOT,
            timeout=300,
            check=False,
        )
    finally:
        os.close(write)
    assert proc.returncode == 141, proc.stderr
    assert "Traceback" not in proc.stderr and "BrokenPipe" not in proc.stderr


def test_ctrl_c_is_one_line_and_exit_130(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import dflash.execution.run as run_module

    def interrupted(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(run_module, "generate", interrupted)
    assert main(["generate", *FAST]) == 130
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1] == "dflash generate: interrupted"
    assert "Traceback" not in err and "KeyboardInterrupt" not in err


# -- option values ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("--seed", "99999999999999999999999"),
        ("--seed", "-1"),
        ("--draft-seed", str(2**63)),
        ("--prompt-seed", "x"),
    ],
)
def test_seed_range_is_named(
    option: str, value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", *FAST, option, value])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {option}: must be an integer in [0, 2**63 - 1]" in err


def test_largest_seed_is_accepted(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "--json", *FAST, "--seed", str(2**63 - 1)]) == 0
    capsys.readouterr()


def test_rollback_mode_is_case_insensitive_in_both_places(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    assert main(["generate", "--json", *FAST, "--rollback", "CHECKPOINT"]) == 0
    cli = json.loads(capsys.readouterr().out)
    monkeypatch.setenv("DFLASH_ROLLBACK", "CHECKPOINT")
    assert main(["generate", "--json", *FAST]) == 0
    env = json.loads(capsys.readouterr().out)
    assert cli["rollback"]["requested"] == env["rollback"]["requested"] == "checkpoint"
    monkeypatch.delenv("DFLASH_ROLLBACK")
    with pytest.raises(SystemExit):
        main(["generate", *FAST, "--rollback", "Fastest"])
    assert "invalid choice: 'fastest'" in capsys.readouterr().err


@pytest.mark.parametrize("option", ["--acceptance", "--drafted-acceptance"])
@pytest.mark.parametrize("draft", ["dflash", "prompt-lookup"])
def test_acceptance_is_refused_for_measured_drafters(
    option: str, draft: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["generate", *FAST, "--draft", draft, option, "0.5"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert f"{option} applies only to --draft synthetic (got --draft {draft})" in err


def test_one_token_has_no_decode_rate(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "--json", *FAST[2:], "--max-new-tokens", "1"]) == 0
    out, err = capsys.readouterr()
    result = json.loads(out)
    assert len(result["tokens"]) == 1 and result["steps"] == 0
    assert result["timings"]["tokens_per_s"] is None
    assert "no decode step" in err
    assert main(["generate", "--json", *FAST[2:], "--max-new-tokens", "3"]) == 0
    timings = json.loads(capsys.readouterr().out)["timings"]
    # the prefill's token is not counted: two tokens came from decode steps
    assert timings["tokens_per_s"] == pytest.approx(2 / timings["decode_s"])


def test_no_progress_bar_when_stderr_is_not_a_terminal() -> None:
    proc = dflash("generate", "--max-new-tokens", "12", "--block-size", "4", "--devices", "cpu")
    assert proc.returncode == 0, proc.stderr
    assert "\r" not in proc.stderr and "tokens  rollback" not in proc.stderr


def test_progress_bar_on_a_terminal() -> None:
    import io

    from dflash.commands.generate import Progress

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    from types import SimpleNamespace

    engine = SimpleNamespace(status=SimpleNamespace(value="off"))
    term, pipe = Terminal(), io.StringIO()
    for stream in (term, pipe):
        bar = Progress(4, stream, enabled=True)
        bar(2, engine)
        bar.close()
    assert "\r[" in term.getvalue() and "2/4 tokens" in term.getvalue()
    assert pipe.getvalue() == ""


# -- memory -------------------------------------------------------------------------------


def test_too_little_memory_names_the_model_size(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import dflash.commands.resources as resources
    import dflash.execution.session as session

    def never(*args: object, **kwargs: object) -> None:  # 40 GB must not be drawn here
        raise AssertionError("the weights were built although they cannot fit")

    monkeypatch.setattr(resources, "available_bytes", lambda device: (2 * 10**9, "test"))
    monkeypatch.setattr(session, "build_model", never)
    code = main(["generate", *FAST, "--model", "nine-b-shape"])
    out, err = capsys.readouterr()
    assert code == 3 and out == ""
    assert "model 'nine-b-shape' has 8.95 B parameters" in err
    assert "needs about 39.9 GB for its weights in float32" in err
    assert "only 2.0 GB is free on cpu" in err and "Traceback" not in err


def test_an_allocation_failure_names_the_model_size(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import dflash.commands.resources as resources
    import dflash.execution.session as session

    def out_of_memory(*args: object, **kwargs: object) -> None:
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 9")

    monkeypatch.setattr(resources, "available_bytes", lambda device: None)
    monkeypatch.setattr(session, "build_model", out_of_memory)
    assert main(["generate", *FAST]) == 3
    err = capsys.readouterr().err
    assert "model 'tiny' has 0.28 M parameters" in err and "ran out of memory" in err


def test_memory_estimate_counts_every_weight() -> None:
    import torch

    from dflash.commands.resources import weight_bytes
    from dflash.model import HybridConfig, TargetModel

    config = HybridConfig.tiny_default()
    model = TargetModel.seeded(config, seed=0)
    params = sum(p.numel() for p in model.parameters())
    largest = max(p.numel() for p in model.parameters())
    assert weight_bytes(config, torch.bfloat16) == (params, 2 * params + 4 * largest)


# -- output paths (fuzz, bench) -------------------------------------------------------------


def test_fuzz_report_is_checked_before_the_campaign(tmp_path: Path) -> None:
    proc = dflash("fuzz", "--seconds", "30", "--engine", "hypothesis", "--report", str(tmp_path))
    assert proc.returncode == 2
    assert "--report names a directory" in proc.stderr and "Traceback" not in proc.stderr
    blocker = tmp_path / "file"
    blocker.write_text("")
    proc = dflash("fuzz", "--seconds", "30", "--report", str(blocker / "r.json"))
    assert proc.returncode == 2 and "is not a directory" in proc.stderr


def test_fuzz_names_a_missing_engine(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import dflash.commands.fuzz as fuzz

    monkeypatch.setattr(fuzz, "installed", lambda package: False)
    report = str(tmp_path / "r.json")
    assert main(["fuzz", "--seconds", "1", "--engine", "atheris", "--report", report]) == 2
    err = capsys.readouterr().err
    assert "the atheris engine needs the 'atheris' package" in err
    assert "pip install 'dflash[fuzz]'" in err and "--engine hypothesis" in err
    monkeypatch.setattr(fuzz, "installed", lambda package: package == "hypothesis")
    assert fuzz.choose_engine("auto") == "hypothesis"


def test_bench_output_paths_are_checked_up_front(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def never(*args: object, **kwargs: object) -> None:
        raise AssertionError("the benchmark ran before its output path was checked")

    monkeypatch.setattr("dflash.commands.bench.prepare", never)
    assert main([*BENCH, "--out", str(tmp_path)]) == 2
    assert "--out names a directory" in capsys.readouterr().err
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert main([*BENCH, "--out", str(blocker / "b.json")]) == 2
    assert "is not a directory" in capsys.readouterr().err
    assert main([*BENCH, "--out", str(tmp_path / "b.json"), "--plot", str(tmp_path)]) == 2
    assert "--plot names a directory" in capsys.readouterr().err
    assert main([*BENCH[:3], "--max-new-tokens", "1"]) == 2
    assert "--max-new-tokens must be >= 2 for bench" in capsys.readouterr().err


def test_bench_without_out_prints_json_and_writes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(BENCH) == 0
    out, err = capsys.readouterr()
    report = json.loads(out)
    assert [p["name"] for p in report["phases"]] == ["A1", "B1", "A2"]
    assert list(tmp_path.iterdir()) == []  # no file in the current directory
    assert "A1/A2 drift" in err


def test_bench_out_writes_json_and_the_plot_beside_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "results" / "b.json"
    assert main([*BENCH, "--out", str(out)]) == 0
    stdout, err = capsys.readouterr()
    assert stdout == ""  # the report went to the file
    assert json.loads(out.read_text())["correct"] is True
    png = out.with_suffix(".png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"plot written to {str(png)!r}" in err


def test_bench_says_up_front_when_matplotlib_is_missing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import dflash.commands.bench as bench

    monkeypatch.setattr(bench, "matplotlib_missing", lambda: True)
    out = tmp_path / "b.json"
    assert main([*BENCH, "--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert "matplotlib is not installed, so no plot will be written" in err
    assert out.exists() and not out.with_suffix(".png").exists()


def test_run_sh_installs_what_fuzz_and_the_plot_need() -> None:
    import re

    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

    script = (ROOT / "scripts" / "run.sh").read_text()
    match = re.search(r'_venv\.sh" "\[([a-z,]+)\]"', script)
    assert match, "scripts/run.sh must install extras"
    extras = set(match.group(1).split(","))
    optional = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    installed = " ".join(dep for name in extras for dep in optional[name])
    for package in ("matplotlib", "atheris", "hypothesis"):
        assert package in installed


@pytest.mark.parametrize(("args", "words"), [
    (["--top-k", "5"], "--top-k 5 filters sampled tokens: give --temperature > 0"),
    (["--top-p", "0.9"], "--top-p 0.9 filters sampled tokens"),
    (["--min-p", "0.1"], "--min-p 0.1 filters sampled tokens"),
    (["--temperature", "1e-38"], "--temperature: 'temperature' must be 0 (greedy) or at least "
                                 "1e-05"),
    (["--prompt-seed", "5"], "--prompt-seed 5 seeds --prompt-len's random ids"),
    (["--draft", "prompt-lookup", "--draft-dtype", "float64"],
     "--draft-dtype=float64 applies to DFlash drafters (the drafter is 'prompt-lookup')"),
    (["--model", ""], "(got '': empty)"),
    (["--model", "README.md"], "(got 'README.md': a file, not a directory)"),
    (["--draft", ""], "--draft must be a non-empty string (got '')"),
])
def test_flags_that_would_change_nothing_or_name_nothing_are_refused(
    args: list[str], words: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["generate", *FAST, *args]) == 2
    out, err = capsys.readouterr()
    assert out == "" and words in err and "Traceback" not in err
