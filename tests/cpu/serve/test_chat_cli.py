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
