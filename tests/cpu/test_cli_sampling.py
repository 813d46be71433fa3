"""``--temperature/--top-k/--top-p/--min-p/--seed``: the main command and the benchmark
draw plain sampled decoding's tokens (``--check-parity`` compares with it), report the
rule, and refuse bad values naming the flag."""

from __future__ import annotations

import json

import pytest

from dflash.cli import main

ARGS = [
    "--model", "tiny", "--draft", "synthetic", "--acceptance", "0.7", "--block-size", "6",
    "--max-new-tokens", "32", "--no-progress", "--devices", "cpu", "--no-baseline",
]


def _run(capsys: pytest.CaptureFixture[str], *extra: str) -> dict[str, object]:
    code = main(["generate", "--json", *ARGS, *extra])
    out, err = capsys.readouterr()
    assert code == 0, err
    result: dict[str, object] = json.loads(out)
    return result


@pytest.mark.parametrize(
    "extra",
    [
        ["--rollback", "checkpoint"],
        ["--rollback", "recompute", "--top-k", "30", "--top-p", "0.9", "--min-p", "0.02"],
        ["--rollback", "remap", "--tree-budget", "8"],
    ],
)
def test_sampled_generation_is_plain_sampled_decoding(
    capsys: pytest.CaptureFixture[str], extra: list[str]
) -> None:
    sampled = _run(capsys, "--temperature", "0.9", "--seed", "4", "--check-parity", *extra)
    filters = {"--top-k", "--top-p", "--min-p"}  # refused at temperature 0 (no effect)
    greedy = _run(capsys, *[a for i, a in enumerate(extra)
                            if a not in filters and extra[i - 1] not in filters])
    assert sampled["parity"] is True
    assert sampled["tokens"] != greedy["tokens"]
    rule = sampled["sampling"]
    assert isinstance(rule, dict) and rule["temperature"] == 0.9 and rule["seed"] == 4
    assert greedy["sampling"] is None
    again = _run(capsys, "--temperature", "0.9", "--seed", "4", *extra)
    other = _run(capsys, "--temperature", "0.9", "--seed", "5", *extra)
    assert again["tokens"] == sampled["tokens"] and other["tokens"] != sampled["tokens"]


def test_the_summary_names_the_rule(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", *ARGS, "--temperature", "0.5", "--top-k", "7"]) == 0
    err = capsys.readouterr().err
    assert "sampling" in err and "temperature 0.5" in err and "top_k 7" in err
    assert "speed-up vs plain sampled" in err  # its own baseline, by name


def test_bench_runs_sampled(capsys: pytest.CaptureFixture[str]) -> None:
    code = main([
        "bench", "--model", "tiny", "--draft", "synthetic", "--acceptance", "0.7",
        "--block-size", "6", "--max-new-tokens", "16", "--devices", "cpu", "--a", "replay",
        "--b", "checkpoint", "--runs", "1", "--warmup", "0", "--plot", "", "--json",
        "--temperature", "1.0", "--seed", "2",
    ])
    out, err = capsys.readouterr()
    assert code == 0, err
    report = json.loads(out)
    assert report["correct"] is True
    assert report["setup"]["sampling"] == {
        "temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "seed": 2
    }
    assert "plain target-only sampled:" in err and "vs plain sampled:" in err


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--temperature", "-1"], "--temperature: 'temperature' must be a number in [0.0, 100.0]"),
        (["--temperature", "nan"], "--temperature: 'temperature'"),
        (["--top-p", "0"], "--top-p: 'top_p' must be a number in (0.0, 1.0]"),
        (["--min-p", "1.5"], "--min-p: 'min_p'"),
        (["--top-k", "-2"], "--top-k: 'top_k' must be an int in [0, 2147483647] (got -2)"),
    ],
)
def test_bad_sampling_flags_are_usage_errors(
    capsys: pytest.CaptureFixture[str], extra: list[str], message: str
) -> None:
    assert main(["generate", *ARGS, *extra]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
