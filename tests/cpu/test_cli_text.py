"""``dflash generate``: text in, text out (tokenizer, streaming, EOS, --bytes, --json)."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest

from dflash.cli import main
from dflash.commands.generate import ByteText, TextPrinter
from dflash.model.tokenizer import TextTokenizer

FAST = [  # the seeded tiny model (the default model is the embedded trained pair)
    "--model", "tiny", "--max-new-tokens", "10", "--block-size", "4", "--devices", "cpu",
    "--no-progress",
]
PROMPT = "for i in"
VOCAB = 300
TRAINING_TEXT = [
    "def add(x, y):\n    return x + y\n",
    "héllo wörld — ünïcode ✓ 日本語のテキスト",
    "for i in range(10):\n    print(i * i)\n",
] * 20


@pytest.fixture(scope="module")
def text_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny seeded model directory with a byte-level BPE tokenizer.json of 300 ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from dflash.model import HybridConfig, TargetModel
    from dflash.model.loading import save_target

    directory = tmp_path_factory.mktemp("text-model")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(TRAINING_TEXT, trainer)
    assert tok.get_vocab_size() == VOCAB
    tok.save(str(directory / "tokenizer.json"))
    config = HybridConfig.tiny_default().model_copy(update={"vocab_size": VOCAB})
    save_target(TargetModel.seeded(config, seed=0), directory)
    return directory


def _tokenizer(directory: Path) -> TextTokenizer:
    from dflash.model.tokenizer import load_tokenizer

    tok = load_tokenizer(directory)
    assert tok is not None
    return tok


def _json(capsys: pytest.CaptureFixture[str], *args: str) -> dict[str, Any]:
    code = main(["generate", "--json", *FAST, *args])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert len(out.splitlines()) == 1  # nothing but the JSON object on stdout
    result: dict[str, Any] = json.loads(out)
    return result


@pytest.fixture(scope="module")
def full(text_model: Path) -> dict[str, Any]:
    """The --json result for PROMPT on the text model (no EOS id in its files)."""
    capture = io.StringIO()
    from contextlib import redirect_stderr, redirect_stdout

    with redirect_stdout(capture), redirect_stderr(io.StringIO()):
        code = main(["generate", "--json", *FAST, "--model", str(text_model), "--prompt", PROMPT])
    assert code == 0
    result: dict[str, Any] = json.loads(capture.getvalue())
    return result


def test_text_prompt_is_tokenized_and_text_streamed(
    text_model: Path, full: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    tok = _tokenizer(text_model)
    result = full
    assert result["prompt_len"] == len(tok.encode(PROMPT))
    assert result["text"] == tok.decode(result["tokens"])
    code = main(["generate", *FAST, "--model", str(text_model), "--prompt", PROMPT])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert out == result["text"] + "\n"  # the streamed text, and no id list after it
    assert f"{len(result['text'])} characters" in err


def test_eos_from_generation_config_and_eos_id_override(
    text_model: Path,
    full: dict[str, Any],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    import shutil

    tok = _tokenizer(text_model)
    eos = full["tokens"][4]
    first = full["tokens"].index(eos)
    model = tmp_path / "with-eos"
    shutil.copytree(text_model, model)
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    cut = _json(capsys, "--model", str(model), "--prompt", PROMPT)
    assert cut["stop_reason"] == "eos" and cut["tokens"] == full["tokens"][: first + 1]
    assert cut["text"] == tok.decode(full["tokens"][:first])  # the EOS token is not text
    # --eos-id wins over the file: an id first seen after the file's EOS id
    later = [t for t in full["tokens"] if full["tokens"].index(t) > first]
    assert later  # the seeded model's continuation has one (deterministic)
    over = _json(capsys, "--model", str(model), "--prompt", PROMPT, "--eos-id", str(later[0]))
    assert over["tokens"] == full["tokens"][: full["tokens"].index(later[0]) + 1]
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": "two"}))
    assert main(["generate", *FAST, "--model", str(model), "--prompt", "x"]) == 2
    assert "generation_config.json" in capsys.readouterr().err


def test_corrupt_tokenizer_names_its_file(
    text_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import shutil

    model = tmp_path / "bad-tokenizer"
    shutil.copytree(text_model, model)
    (model / "tokenizer.json").write_text('{"model": 3')
    assert main(["generate", *FAST, "--model", str(model), "--prompt", "x"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert str(model / "tokenizer.json") in err and "corrupt" in err and "Traceback" not in err


def test_text_prompt_without_tokenizer_needs_bytes(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", *FAST, "--prompt", "hello"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "needs a tokenizer" in err and "--bytes" in err
    result = _json(capsys, "--prompt", "hello", "--bytes")
    assert result["prompt_len"] == len(b"hello")
    assert result["text"] == ByteText().decode(result["tokens"])
    ids = _json(capsys, "--prompt-ids", "3,14,15")
    assert ids["text"] is None  # no tokenizer, no --bytes: ids only


def test_bytes_is_refused_with_a_tokenizer(
    text_model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["generate", *FAST, "--model", str(text_model), "--prompt", "x", "--bytes"]) == 2
    assert "--bytes is for models without a tokenizer" in capsys.readouterr().err


def test_streaming_holds_back_split_characters(text_model: Path) -> None:
    # bytes: "日" is three UTF-8 bytes; nothing is printed until the last one arrives
    out = io.StringIO()
    printer = TextPrinter(ByteText(), eos_id=None, out=out)
    data = list("a日b".encode())
    for n in range(1, len(data) + 1):
        printer.update(data[:n])
        shown = out.getvalue()
        assert "\ufffd" not in shown
        assert shown == "a日b"[: len(bytes(data[:n]).decode("utf-8", errors="ignore"))]
    assert printer.finish(data) == "a日b" and out.getvalue() == "a日b\n"
    # a BPE tokenizer: one id at a time gives the same text as decoding all ids at once
    tok = _tokenizer(text_model)
    ids = [*tok.encode("héllo wörld ✓ 日本語 " * 3), 5, 200, 131, 7]
    out = io.StringIO()
    printer = TextPrinter(tok, eos_id=None, out=out)
    for n in range(1, len(ids) + 1):
        printer.update(ids[:n])
        assert "\ufffd" not in out.getvalue() or n == len(ids)
    assert printer.finish(ids) == tok.decode(ids)
    assert out.getvalue() == tok.decode(ids) + "\n"


def test_streaming_stops_before_eos() -> None:
    out = io.StringIO()
    printer = TextPrinter(ByteText(), eos_id=ord("!"), out=out)
    assert printer.finish(list(b"hi!there")) == "hi"
    assert out.getvalue() == "hi\n"
