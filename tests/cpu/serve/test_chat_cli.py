"""``dflash chat``: each stdin line a user turn, the reply the library's generation of the
conversation rendered by the chat template; ``/reset`` forgets the conversation."""

from __future__ import annotations

import io

import pytest

import dflash
from dflash.cli import main


def test_a_conversation_on_the_terminal(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr("sys.stdin", io.StringIO("def add(a, b):\nimport os\n/reset\nx = 1\n"))
    assert main(["chat", "--max-tokens", "8"]) == 0
    out, err = capsys.readouterr()
    llm = dflash.load()
    first = [{"role": "user", "content": "def add(a, b):"}]
    a = llm.generate(llm.render_chat(first), max_new_tokens=8).text or ""
    second = [*first, {"role": "assistant", "content": a},
              {"role": "user", "content": "import os"}]
    b = llm.generate(llm.render_chat(second), max_new_tokens=8).text or ""
    c = llm.generate(llm.render_chat([{"role": "user", "content": "x = 1"}]),
                     max_new_tokens=8).text or ""
    assert out == f"{a}\n{b}\n{c}\n"
    assert err.count("tokens/s") == 3 and "(conversation reset)" in err


def test_a_turn_past_the_context_is_dropped_and_the_conversation_goes_on(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The too-long message is reported on stderr and left out; the next line is answered
    as the conversation without it; the session ends with exit 1."""
    too_long = "x = 1; " * 6000
    monkeypatch.setattr("sys.stdin", io.StringIO(f"{too_long}\ndef add(a, b):\n"))
    assert main(["chat", "--max-tokens", "8"]) == 1
    out, err = capsys.readouterr()
    assert "exceed the model's max_position_embeddings" in err and "dropped" in err
    assert "--max-tokens=8" in err
    llm = dflash.load()
    want = llm.generate(llm.render_chat([{"role": "user", "content": "def add(a, b):"}]),
                        max_new_tokens=8).text or ""
    assert out == f"{want}\n"


@pytest.mark.parametrize(("flags", "words"), [
    (["--max-tokens", "0"], "--max-tokens must be >= 1 (got 0)"),
    (["--temperature", "-1"], "--temperature"),
    (["--top-k", "5"], "--top-k 5 filters sampled tokens: give --temperature > 0"),
    (["--stop", ""], "--stop must not be empty"),
])
def test_chat_flags_are_checked_before_any_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], flags: list[str],
    words: str,
) -> None:
    monkeypatch.setattr("sys.stdin", io.StringIO(""))  # no line: only the flags are read
    assert main(["chat", *flags]) == 2
    assert words in capsys.readouterr().err
