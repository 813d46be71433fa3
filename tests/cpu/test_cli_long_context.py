"""``--prefill-chunk`` and ``--max-context`` on the command line and in the library: the
prefill's rate in the result, every bad value refused naming it (exit 2), a context that
cannot fit refused with its estimate (exit 3) before any cache exists."""

from __future__ import annotations

import json

import pytest

import dflash
from dflash.cli import main
from dflash.errors import UsageError
from dflash.execution.errors import ContextLengthError

FAST = ["--model", "tiny", "--max-new-tokens", "6", "--block-size", "4", "--devices", "cpu",
        "--no-progress", "--draft", "prompt-lookup"]


def _json(capsys: pytest.CaptureFixture[str], args: list[str]) -> dict[str, object]:
    code = main(["generate", *FAST, *args, "--json"])
    out = capsys.readouterr().out
    assert code == 0, out
    data: dict[str, object] = json.loads(out)
    return data


def test_a_chunked_prefill_reports_its_rate_and_keeps_parity(
    capsys: pytest.CaptureFixture[str],
) -> None:
    one = _json(capsys, ["--prompt-len", "23", "--prefill-chunk", "0", "--check-parity",
                         "--no-baseline"])
    chunked = _json(capsys, ["--prompt-len", "23", "--prefill-chunk", "5", "--check-parity",
                             "--no-baseline", "--max-context", "100"])
    for r in (one, chunked):
        assert r["parity"] is True and r["prompt_len"] == 23 and r["cached_tokens"] == 0
        timings = r["timings"]
        assert isinstance(timings, dict) and timings["prefill_tokens_per_s"] > 0
    assert chunked["tokens"] == one["tokens"]


@pytest.mark.parametrize(("args", "words"), [
    (["--prefill-chunk", "-1"], "--prefill-chunk must be >= 1, or 0 for one forward (got -1)"),
    (["--max-context", "0"], "--max-context must be in [1, 4096]"),
    (["--max-context", "4097"], "--max-context must be in [1, 4096]"),
    (["--max-context", "10", "--prompt-len", "8"],
     "prompt of 8 tokens + max_new_tokens=6 = 14 tokens exceed max_context=10"),
    (["--draft-window", "0"], "--draft-window must be >= 1 (got 0)"),
    (["--draft-window", "64"], "--draft-window=64 applies to DFlash drafters (the drafter is "
                               "'prompt-lookup')"),
])
def test_bad_values_are_refused_naming_them(
    capsys: pytest.CaptureFixture[str], args: list[str], words: str
) -> None:
    assert main(["generate", *FAST, *args]) == 2
    err = capsys.readouterr().err
    assert words in err and "Traceback" not in err


def test_a_context_that_cannot_fit_exits_3_with_its_estimate(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import dflash.execution.memory as memory

    monkeypatch.setattr(memory, "available_bytes", lambda device: (3 * 10**6, "test"))
    assert main(["generate", *FAST, "--max-context", "4096", "--no-baseline"]) == 3
    err = capsys.readouterr().err
    assert "InsufficientMemoryError: a context of 4101 positions" in err
    assert "KV " in err and "prefill workspace" in err and "only 3.0 MB is free" in err
    assert "Traceback" not in err


def test_the_library_takes_both(monkeypatch: pytest.MonkeyPatch) -> None:
    prompt = [(3 * i + 1) % 256 for i in range(30)]
    plain = dflash.load(model="tiny", draft="prompt-lookup").generate(prompt, max_new_tokens=8)
    llm = dflash.load(model="tiny", draft="prompt-lookup", prefill_chunk=4, max_context=64)
    got = llm.generate(prompt, max_new_tokens=8)
    assert got.tokens == plain.tokens and got.timings.prefill_tokens_per_s
    assert llm.target is not None and llm.target.max_len == 64 + 16 + 1
    with pytest.raises(ContextLengthError, match="exceed max_context=64"):
        llm.generate(prompt, max_new_tokens=40)
    windowed = dflash.load(model="tiny", draft="dflash+lookup", draft_window=8)
    assert windowed.drafter is not None
    assert windowed.generate(prompt, max_new_tokens=8).tokens == plain.tokens
    for bad, words in (({"prefill_chunk": 0}, "'prefill_chunk' must be an int >= 1"),
                       ({"max_context": 5000}, "'max_context' must be an int in [1, 4096]"),
                       ({"draft": None, "draft_window": 8}, "'draft_window'=8 needs a DFlash"),
                       ({"draft_window": 0}, "'draft_window' must be an int >= 1")):
        with pytest.raises(UsageError, match=words.replace("[", r"\[").replace("]", r"\]")):
            dflash.load(model="tiny", **bad)
