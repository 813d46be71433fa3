"""Training data for the drafter: token streams from files, and the target's own responses.

Inputs: ``.npy`` files (1-D int32/int64 token ids) or text files (UTF-8), each a document;
directories are searched recursively (``.npy``, ``.txt``, ``.md``, ``.text``, ``.jsonl``
lines read as text). Text is tokenized with the target's ``tokenizer.json`` (the
``tokenizers`` library); a target without one (the built-in models, vocabulary >= 256)
reads text as UTF-8 bytes.

Teacher tokens (``teacher="generate"``, the default): prompts are windows of the data and
the training sequences are ``prompt + the target's own greedy continuation``, generated
in batches with the frozen target's decode mode (plain greedy decoding), so the drafter
learns to predict exactly what it will be verified against; ``teacher="data"`` trains on
raw data windows instead (no generation cost, but a distribution the target may not
follow).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from dflash.errors import UsageError
from dflash.model import TargetModel

TEXT_SUFFIXES = (".txt", ".md", ".text", ".jsonl")


class DataError(UsageError):
    """A data path, file or setting that cannot be used; names the value."""


def data_files(paths: Sequence[str | Path]) -> list[Path]:
    """Every usable file under ``paths`` (files as given, directories recursively), sorted."""
    files: list[Path] = []
    for raw in paths:
        path = Path(raw)
        if path.is_dir():
            found = sorted(
                p for p in path.rglob("*") if p.is_file() and p.suffix in (".npy", *TEXT_SUFFIXES)
            )
            if not found:
                raise DataError(
                    f"data directory {str(path)!r} holds no .npy or text files "
                    f"({', '.join(TEXT_SUFFIXES)}; other files can be named one by one)"
                )
            files.extend(found)
        elif path.is_file():
            files.append(path)
        else:
            raise DataError(f"data path {str(path)!r} does not exist")
    return files


class Encoder:
    """Text → token ids with the target's ``tokenizer.json``, or UTF-8 bytes without one."""

    def __init__(self, model_dir: Path | None, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self._tokenizer = None
        tok_file = None if model_dir is None else model_dir / "tokenizer.json"
        if tok_file is not None and tok_file.is_file():
            from tokenizers import Tokenizer

            self._tokenizer = Tokenizer.from_file(str(tok_file))
        elif vocab_size < 256:
            raise DataError(
                f"text data needs the target's tokenizer.json (none found) or a vocabulary of "
                f">= 256 ids for UTF-8 bytes (the target has {vocab_size}); pass .npy token files"
            )

    def encode(self, text: str) -> list[int]:
        if self._tokenizer is None:
            return list(text.encode("utf-8"))
        ids: list[int] = self._tokenizer.encode(text).ids
        return ids


def read_documents(
    paths: Sequence[str | Path], encoder: Encoder | None, vocab_size: int
) -> list[np.ndarray]:
    """One int64 array per document; every id checked against ``vocab_size``."""
    docs: list[np.ndarray] = []
    for path in data_files(paths):
        if path.suffix == ".npy":
            try:
                arr = np.load(path, allow_pickle=False)
            except (OSError, ValueError) as exc:
                raise DataError(f"{path}: not a readable .npy file ({exc})") from exc
            if arr.ndim != 1 or arr.dtype not in (np.int32, np.int64):
                raise DataError(
                    f"{path}: token files must be 1-D int32/int64 (got {arr.ndim}-D {arr.dtype})"
                )
            ids = arr.astype(np.int64)
        else:
            if encoder is None:
                raise DataError(f"{path}: text data needs an encoder")
            try:
                text = path.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as exc:
                raise DataError(f"{path}: not readable UTF-8 text ({exc})") from exc
            if path.suffix == ".jsonl":
                text = "\n".join(_jsonl_texts(path, text))
            ids = np.asarray(encoder.encode(text), dtype=np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
            raise DataError(
                f"{path}: token ids must lie in [0, {vocab_size}) "
                f"(got min {int(ids.min())}, max {int(ids.max())})"
            )
        if ids.size:
            docs.append(ids)
    if not docs:
        raise DataError(f"no tokens in the data {[str(p) for p in paths]}")
    return docs


def _jsonl_texts(path: Path, text: str) -> list[str]:
    """The string values of each JSON line (``text``, ``content``, … whatever is there)."""
    out: list[str] = []
    for i, line in enumerate(text.splitlines()):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DataError(f"{path}: line {i + 1} is not JSON ({exc})") from exc
        if isinstance(row, str):
            out.append(row)
        elif isinstance(row, dict):
            out.extend(v for v in row.values() if isinstance(v, str))
    return out


def windows(docs: Sequence[np.ndarray], length: int, count: int, seed: int) -> np.ndarray:
    """``count`` windows of ``length`` tokens from the concatenated documents: [count, length]."""
    stream = np.concatenate(list(docs))
    if stream.size < length:
        raise DataError(f"the data holds {stream.size} tokens, fewer than one window of {length}")
    rng = np.random.default_rng(seed)
    starts = rng.integers(0, stream.size - length + 1, size=count)
    return np.stack([stream[s : s + length] for s in starts])


@dataclass(frozen=True)
class TrainingSet:
    """Sequences ``[count, seq_len]`` and the first position whose token is a label."""

    tokens: np.ndarray
    label_start: int  # anchors are drawn from [label_start, seq_len - B]


@torch.no_grad()
def greedy_continuations(
    model: TargetModel, prompts: np.ndarray, new_tokens: int, batch: int
) -> np.ndarray:
    """The target's greedy continuation of each prompt row: [P, new_tokens] (batched)."""
    device = model.embed_tokens.weight.device
    out = np.empty((prompts.shape[0], new_tokens), dtype=np.int64)
    length = prompts.shape[1]
    for lo in range(0, prompts.shape[0], batch):
        rows = torch.as_tensor(prompts[lo : lo + batch], device=device)
        caches = model.new_caches(max_len=length + new_tokens, max_draft=1, batch=rows.shape[0])
        logits, _ = model(rows, caches, "prefill")
        nxt = logits[:, -1].argmax(-1)  # [b]
        made = [nxt]
        for _ in range(new_tokens - 1):
            logits, _ = model(nxt[:, None], caches, "decode")
            nxt = logits[:, -1].argmax(-1)
            made.append(nxt)
        out[lo : lo + rows.shape[0]] = torch.stack(made, dim=1).cpu().numpy()
    return out


def teacher_set(
    model: TargetModel,
    docs: Sequence[np.ndarray],
    *,
    seq_len: int,
    prompt_len: int,
    count: int,
    seed: int,
    batch: int,
) -> TrainingSet:
    """``count`` sequences of ``prompt_len`` data tokens + the target's greedy response."""
    if not 1 <= prompt_len < seq_len:
        raise DataError(f"'prompt_len' must be in [1, seq_len={seq_len}) (got {prompt_len})")
    prompts = windows(docs, prompt_len, count, seed)
    responses = greedy_continuations(model, prompts, seq_len - prompt_len, batch)
    return TrainingSet(np.concatenate([prompts, responses], axis=1), prompt_len)


def data_set(docs: Sequence[np.ndarray], *, seq_len: int, count: int, seed: int) -> TrainingSet:
    """``count`` raw data windows of ``seq_len`` tokens (labels from position 1 on)."""
    return TrainingSet(windows(docs, seq_len, count, seed), 1)
