"""Text in and out: a model directory's ``tokenizer.json`` and its end-of-sequence id.

``tokenizer.json`` is read with the ``tokenizers`` library (the Hugging Face fast-tokenizer
format; no ``transformers`` needed). A file that cannot be parsed raises
:class:`TokenizerError` naming the file.

API::

    tok = load_tokenizer(directory)        # TextTokenizer, or None without tokenizer.json
    ids = tok.encode("def f(x):")          # list[int] (no special tokens added)
    text = tok.decode(ids)                 # str (special tokens kept as their text)
    stream = tok.stream()                  # incremental decoding for streamed output
    piece = stream.push(new_ids)           # the text the new ids complete ("" while a
    rest = stream.flush()                  #   UTF-8 character is still split)
    eos = eos_token_ids(directory)         # tuple[int, ...], from generation_config.json,
                                           #   else config.json (() when it names none)
    first = eos_token_id(directory)        # int | None: the first of them
    require_utf8(text, "prompt")           # TextEncodingError unless text is valid UTF-8
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from dflash.errors import CheckpointError, UsageError, param

TOKENIZER_FILE = "tokenizer.json"
_REPLACEMENT = "\ufffd"


class TokenizerError(CheckpointError):
    """A tokenizer or EOS setting that cannot be used; the message names the file."""


class TextEncodingError(UsageError):
    """Text that is not valid UTF-8; the message names the parameter, byte and offset."""


def require_utf8(text: str, what: str) -> None:
    """Refuse ``text`` unless it encodes as UTF-8 (:class:`TextEncodingError` naming ``what``).

    A Python ``str`` can hold lone surrogates: the command line's arguments carry each
    byte that is not valid UTF-8 as one (``surrogateescape``: byte ``0xff`` becomes
    ``U+DCFF``), and no tokenizer takes them. The message names the first such byte as
    the command line received it (``U+DC80`` … ``U+DCFF`` are bytes ``0x80`` … ``0xff``),
    or the surrogate's code point for any other, at its offset in the UTF-8 bytes.
    """
    try:
        text.encode("utf-8")
        return
    except UnicodeEncodeError:
        pass
    offset = 0
    for ch in text:
        code = ord(ch)
        if 0xDC80 <= code <= 0xDCFF:
            what_bad = f"byte 0x{code - 0xDC00:02x}"
        elif 0xD800 <= code <= 0xDFFF:
            what_bad = f"lone surrogate U+{code:04X}"
        else:
            offset += len(ch.encode("utf-8"))
            continue
        raise TextEncodingError(
            f"{param(what)} is not valid UTF-8: {what_bad} at offset {offset}"
        )


class TextTokenizer:
    """A ``tokenizers.Tokenizer`` read from one ``tokenizer.json`` file."""

    def __init__(self, backend: Any, path: Path) -> None:
        self._backend = backend
        self.path = path

    @classmethod
    def from_file(cls, path: str | Path) -> TextTokenizer:
        """Read ``path`` (a ``tokenizer.json``); :class:`TokenizerError` names a bad file."""
        path = Path(path)
        try:
            from tokenizers import Tokenizer
        except ImportError:  # pragma: no cover - tokenizers is a dependency
            raise TokenizerError(
                f"reading {str(path)!r} needs the 'tokenizers' package (pip install tokenizers)"
            ) from None
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as exc:
            raise TokenizerError(
                f"cannot read tokenizer file {str(path)!r}: {exc.strerror}"
            ) from exc
        except UnicodeDecodeError as exc:
            raise TokenizerError(
                f"tokenizer file {str(path)!r} is corrupt: not UTF-8 text ({exc.reason})"
            ) from exc
        try:
            backend = Tokenizer.from_str(text)
        except Exception as exc:  # the Rust parser raises a bare Exception subclass
            first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise TokenizerError(f"tokenizer file {str(path)!r} is corrupt: {first}") from exc
        return cls(backend, path)

    @property
    def vocab_size(self) -> int:
        """Number of ids, special tokens included (the largest id is ``vocab_size - 1``)."""
        return int(self._backend.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; no special tokens are added."""
        if not isinstance(text, str):
            raise TokenizerError(f"encode expects a str (got {type(text).__name__})")
        require_utf8(text, "text")  # the backend takes no lone surrogates
        return list(self._backend.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int]) -> str:
        """The text of ``ids``; special tokens appear as their text (e.g. ``<|endoftext|>``).

        Ids from ``vocab_size`` up have no text and decode as nothing, as transformers'
        tokenizers decode them: a model's vocabulary may be padded past its tokenizer's
        (Qwen's to a multiple of 256), and sampling may draw such an id. A negative id is a
        :class:`TokenizerError`."""
        ids = list(ids)
        bad = next((t for t in ids if isinstance(t, bool) or not isinstance(t, int)), None)
        if bad is not None:
            raise TokenizerError(f"decode expects integer ids (got {bad!r})")
        negative = [t for t in ids if t < 0]
        if negative:
            raise TokenizerError(
                f"token id {negative[0]} is outside the vocabulary [0, {self.vocab_size}) of "
                f"{str(self.path)!r}"
            )
        size = self.vocab_size
        return str(self._backend.decode([t for t in ids if t < size], skip_special_tokens=False))

    def token_id(self, token: str) -> int | None:
        """The id of the token spelled ``token`` (e.g. ``"<|endoftext|>"``), or None."""
        found = self._backend.token_to_id(token)
        return None if found is None else int(found)

    def stream(self) -> TextStream:
        """A fresh incremental decoder (see :class:`TextStream`)."""
        return TextStream(self)


class TextStream:
    """Incremental decoding: ``push`` returns the text that newly pushed ids complete.

    Byte-level tokens may split a UTF-8 character; text is held back while the decoded
    tail ends in an incomplete character, so the concatenation of everything ``push`` and
    ``flush`` return equals ``decode`` of all ids.
    """

    # ids kept before the pending ones, so merges at the boundary decode in context
    _CONTEXT = 4

    def __init__(self, tokenizer: TextTokenizer) -> None:
        self._tok = tokenizer
        self._ids: list[int] = []
        self._prefix = 0  # start of the decode window
        self._read = 0  # ids before this index have been emitted

    def push(self, ids: Iterable[int]) -> str:
        self._ids.extend(ids)
        window = self._ids[self._prefix :]
        done = self._tok.decode(self._ids[self._prefix : self._read])
        text = self._tok.decode(window)
        if text.endswith(_REPLACEMENT) or len(text) < len(done):
            return ""  # an incomplete character: wait for its remaining bytes
        new = text[len(done) :]
        self._read = len(self._ids)
        self._prefix = max(0, self._read - self._CONTEXT)
        return new

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character decodes as U+FFFD)."""
        done = self._tok.decode(self._ids[self._prefix : self._read])
        text = self._tok.decode(self._ids[self._prefix :])
        self._read = len(self._ids)
        self._prefix = self._read
        return text[len(done) :]


def find_tokenizer(directory: str | Path) -> Path | None:
    """``directory/tokenizer.json`` if it exists, else None."""
    path = Path(directory) / TOKENIZER_FILE
    return path if path.exists() else None


def load_tokenizer(directory: str | Path) -> TextTokenizer | None:
    """The tokenizer of a model directory, or None when it has no ``tokenizer.json``."""
    path = find_tokenizer(directory)
    return None if path is None else TextTokenizer.from_file(path)


def _json_object(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise TokenizerError(f"cannot read {str(path)!r}: {exc.strerror}") from exc
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise TokenizerError(f"{str(path)!r} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise TokenizerError(f"{str(path)!r} must hold a JSON object (got {type(data).__name__})")
    return data


def _eos_values(value: Any, path: Path, field: str) -> tuple[int, ...]:
    """An ``eos_token_id`` entry: an id, a list of ids (Qwen's instruct models list two:
    the turn's end and the text's), or null (none)."""
    if value is None:
        return ()
    values, fields = ((value, [f"{field}[{i}]" for i in range(len(value))])
                      if isinstance(value, list) else ([value], [field]))
    for v, f in zip(values, fields, strict=True):
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise TokenizerError(
                f"{str(path)!r} field {f!r} must be a non-negative token id (got {v!r})"
            )
    return tuple(dict.fromkeys(values))   # in order, once each


def eos_token_ids(directory: str | Path) -> tuple[int, ...]:
    """The end-of-sequence ids of a model directory, in their order (empty when it names
    none): generation stops at any of them.

    Read from ``generation_config.json`` when it has ``eos_token_id``, else from
    ``config.json`` (top level, then ``text_config``); an id or a list of ids.
    """
    directory = Path(directory)
    gen = directory / "generation_config.json"
    if gen.is_file():
        data = _json_object(gen)
        if data.get("eos_token_id") is not None:
            return _eos_values(data["eos_token_id"], gen, "eos_token_id")
    cfg = directory / "config.json"
    if cfg.is_file():
        data = _json_object(cfg)
        if data.get("eos_token_id") is not None:
            return _eos_values(data["eos_token_id"], cfg, "eos_token_id")
        text = data.get("text_config")
        if isinstance(text, dict) and text.get("eos_token_id") is not None:
            return _eos_values(text["eos_token_id"], cfg, "text_config.eos_token_id")
    return ()


def eos_token_id(directory: str | Path) -> int | None:
    """The first of :func:`eos_token_ids`, or None when the directory names none."""
    ids = eos_token_ids(directory)
    return ids[0] if ids else None
