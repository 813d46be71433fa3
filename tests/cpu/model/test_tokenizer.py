"""dflash.model.tokenizer: tokenizer.json loading, round trips, streaming, EOS lookup."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dflash.model.tokenizer import (
    TextTokenizer,
    TokenizerError,
    eos_token_id,
    eos_token_ids,
    find_tokenizer,
    load_tokenizer,
)

tokenizers = pytest.importorskip("tokenizers")

CORPUS = [
    "def add(a, b):\n    return a + b\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
    "for i in range(10):\n    print(i)  # numbers\n",
    "import os\nimport sys\n\nif __name__ == '__main__':\n    sys.exit(main())\n",
] * 4
TEXTS = [
    "def f(x):\n    return x * 2\n",
    "    indented\tand tabs\n\n\n",
    "naïve café — ünïcødé ✓ 🐍 中文",  # multi-byte characters split across byte tokens
    "",
]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer=trainer)
    tok.add_special_tokens(["<|mask|>"])
    directory = tmp_path_factory.mktemp("tok")
    tok.save(str(directory / "tokenizer.json"))
    return directory


@pytest.fixture(scope="module")
def tok(tok_dir: Path) -> TextTokenizer:
    loaded = load_tokenizer(tok_dir)
    assert loaded is not None
    return loaded


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(tok: TextTokenizer, text: str) -> None:
    ids = tok.encode(text)
    assert all(0 <= t < tok.vocab_size for t in ids)
    assert tok.decode(ids) == text


def test_merges_apply_and_special_tokens_are_ids(tok: TextTokenizer) -> None:
    text = "def add(a, b):\n    return a + b\n"
    assert len(tok.encode(text)) < len(text.encode("utf-8"))  # BPE merged something
    assert tok.token_id("<|endoftext|>") == 0
    assert tok.token_id("<|mask|>") == tok.vocab_size - 1
    assert tok.token_id("<|no such token|>") is None
    assert tok.decode([0]) == "<|endoftext|>"


@pytest.mark.parametrize("text", TEXTS)
def test_stream_one_id_at_a_time_equals_decode(tok: TextTokenizer, text: str) -> None:
    ids = tok.encode(text)
    stream = tok.stream()
    pieces = [stream.push([t]) for t in ids]
    pieces.append(stream.flush())
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)  # no half characters are ever emitted


def test_stream_in_chunks(tok: TextTokenizer) -> None:
    text = "".join(TEXTS)
    ids = tok.encode(text)
    stream = tok.stream()
    out = "".join(stream.push(ids[i : i + 3]) for i in range(0, len(ids), 3)) + stream.flush()
    assert out == text


def test_stream_flush_releases_an_incomplete_character(tok: TextTokenizer) -> None:
    ids = tok.encode("🐍")
    assert len(ids) > 1  # the emoji's 4 bytes are not one token in this vocabulary
    stream = tok.stream()
    assert stream.push(ids[:1]) == ""  # held back
    assert stream.flush() == "\ufffd"


def test_decode_rejects_bad_ids(tok: TextTokenizer) -> None:
    with pytest.raises(TokenizerError, match=r"token id -1 is outside .*tokenizer\.json"):
        tok.decode([1, -1])
    with pytest.raises(TokenizerError, match="integer ids"):
        tok.decode([1, True])
    with pytest.raises(TokenizerError, match="expects a str"):
        tok.encode(b"bytes")  # type: ignore[arg-type]  # the wrong type on purpose


def test_ids_past_the_tokenizer_decode_as_nothing(tok: TextTokenizer) -> None:
    """A model vocabulary padded past its tokenizer's (Qwen's): an id the tokenizer does
    not know has no text, in a whole decode and in a stream, instead of failing the
    generation that drew it."""
    ids = tok.encode("def f(x):\n    return x")
    past = [tok.vocab_size, tok.vocab_size + 255, 10**9]
    mixed = [ids[0], past[0], *ids[1:3], past[1], *ids[3:], past[2]]
    assert tok.decode(mixed) == tok.decode(ids)
    stream = tok.stream()
    assert "".join(stream.push([t]) for t in mixed) + stream.flush() == tok.decode(ids)


def test_missing_tokenizer_is_none(tmp_path: Path) -> None:
    assert find_tokenizer(tmp_path) is None
    assert load_tokenizer(tmp_path) is None
    with pytest.raises(TokenizerError, match="cannot read tokenizer file"):
        TextTokenizer.from_file(tmp_path / "tokenizer.json")


@pytest.mark.parametrize(
    "content",
    [b"{not json", b'{"model": {"type": "NoSuchModel"}}', b"\xff\xfe\x00garbage", b""],
    ids=["bad-json", "bad-model", "not-utf8", "empty"],
)
def test_corrupt_tokenizer_names_its_file(tmp_path: Path, content: bytes) -> None:
    (tmp_path / "tokenizer.json").write_bytes(content)
    with pytest.raises(TokenizerError, match=r"tokenizer\.json.* is corrupt") as info:
        load_tokenizer(tmp_path)
    assert str(tmp_path / "tokenizer.json") in str(info.value)


def _write(directory: Path, name: str, data: object) -> None:
    (directory / name).write_text(json.dumps(data), encoding="utf-8")


def test_eos_from_generation_config_first(tmp_path: Path) -> None:
    _write(tmp_path, "generation_config.json", {"eos_token_id": 7})
    _write(tmp_path, "config.json", {"eos_token_id": 3})
    assert eos_token_id(tmp_path) == 7


def test_eos_list_gives_every_id_in_order(tmp_path: Path) -> None:
    """Qwen's instruct checkpoints list two EOS ids; generation stops at either."""
    _write(tmp_path, "generation_config.json", {"eos_token_id": [5, 9, 5]})
    assert eos_token_ids(tmp_path) == (5, 9)
    assert eos_token_id(tmp_path) == 5
    _write(tmp_path, "generation_config.json", {"eos_token_id": []})
    assert eos_token_ids(tmp_path) == () and eos_token_id(tmp_path) is None
    _write(tmp_path, "generation_config.json", {"eos_token_id": [5, "9"]})
    with pytest.raises(TokenizerError, match=r"'eos_token_id\[1\]' must be a non-negative "
                                             r"token id \(got '9'\)"):
        eos_token_ids(tmp_path)


def test_eos_falls_back_to_config(tmp_path: Path) -> None:
    _write(tmp_path, "generation_config.json", {"pad_token_id": 1})
    _write(tmp_path, "config.json", {"eos_token_id": 3})
    assert eos_token_id(tmp_path) == 3
    _write(tmp_path, "config.json", {"text_config": {"eos_token_id": 4}})
    assert eos_token_id(tmp_path) == 4


def test_eos_absent_is_none(tmp_path: Path) -> None:
    assert eos_token_id(tmp_path) is None
    _write(tmp_path, "config.json", {"eos_token_id": None})
    assert eos_token_id(tmp_path) is None


@pytest.mark.parametrize("value", ["2", -1, True, 1.5, [None]])
def test_bad_eos_names_file_and_field(tmp_path: Path, value: object) -> None:
    _write(tmp_path, "generation_config.json", {"eos_token_id": value})
    with pytest.raises(TokenizerError, match=r"generation_config\.json.*'eos_token_id"):
        eos_token_id(tmp_path)


def test_eos_bad_json_names_file(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{", encoding="utf-8")
    with pytest.raises(TokenizerError, match=r"config\.json.* is not valid JSON"):
        eos_token_id(tmp_path)
