"""Building what a generation needs from command-line style names.

- models: ``default`` (the embedded trained pair's target, shipped as package data; see
  :mod:`dflash.data`), the seeded random models ``tiny`` (:meth:`TargetModel.tiny_default`
  shape), ``nine-b-shape`` and ``twenty-seven-b-shape`` (the shapes of Qwen3.5-9B and
  Qwen3.5-27B, for benchmarks), or a Hugging Face checkpoint directory. Names win over
  directories: write ``./tiny`` to load a directory of that name;
- drafters: ``dflash`` (with ``--model default`` the shipped trained drafter, else a seeded
  DFlash block drafter shaped for the target), ``prompt-lookup``, ``synthetic`` (SYNTHETIC
  acceptance profile; needs the target's own greedy continuation, computed here), or a
  DFlash drafter checkpoint directory; ``+lookup`` after a DFlash spec (``dflash+lookup``,
  ``DIR+lookup``): that drafter assisted by prompt lookup;
- prompts: explicit ids, text (the model directory's ``tokenizer.json``; a model without
  one encodes UTF-8 bytes as ids when ``allow_bytes``), or ``N`` seeded random ids.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path

import torch

from dflash.data import DefaultDataMissingError, default_dir, require_default
from dflash.errors import UsageError
from dflash.execution.oracle import reference_greedy
from dflash.execution.shards import ShardPlan
from dflash.model import HybridConfig, TargetModel
from dflash.model.drafters import LOOKUP_SUFFIX, Drafter, make_drafter
from dflash.model.tokenizer import TextTokenizer, TokenizerError, eos_token_id, load_tokenizer

DEFAULT_MODEL = "default"
SEEDED_MODELS = ("tiny", "nine-b-shape", "twenty-seven-b-shape")
BUILTIN_MODELS = (DEFAULT_MODEL, *SEEDED_MODELS)
DEFAULT_PROMPT = (  # code, like the embedded pair's training data (the standard library)
    "import os\n\n\ndef read_lines(path, encoding=\"utf-8\"):\n"
    "    \"\"\"Return the lines of the file at *path* without line endings.\"\"\"\n"
)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class SessionError(UsageError):
    """A model, drafter, dtype or prompt argument that cannot be used; names the value."""


def parse_dtype(name: str | None, model: str, device: str) -> torch.dtype:
    """``--dtype``; by default float32 for ``tiny`` or on CPU, else bfloat16."""
    if name is None:
        big = model != "tiny" and device.startswith("cuda")
        return torch.bfloat16 if big else torch.float32
    if name not in DTYPES:
        raise SessionError(f"--dtype must be one of {', '.join(DTYPES)} (got {name!r})")
    return DTYPES[name]


def model_directory(spec: str) -> Path | None:
    """The checkpoint directory ``spec`` names (None for a seeded model)."""
    if spec in SEEDED_MODELS:
        return None
    if spec == DEFAULT_MODEL:
        try:
            return require_default("target")
        except DefaultDataMissingError as exc:
            raise SessionError(f"--model default: {exc}") from None
    if Path(spec).is_dir():
        return Path(spec)
    raise SessionError(
        f"--model must be one of {', '.join(BUILTIN_MODELS)} or a checkpoint directory "
        f"(got {spec!r}: no such directory)"
    )


def model_config(spec: str) -> HybridConfig:
    """The configuration of the model named by ``spec``, without building any weights."""
    if spec == "tiny":
        return HybridConfig.tiny_default()
    if spec == "nine-b-shape":
        return HybridConfig.nine_b_shape()
    if spec == "twenty-seven-b-shape":
        return HybridConfig.twenty_seven_b_shape()
    directory = model_directory(spec)
    assert directory is not None  # only seeded names have no directory
    return HybridConfig.from_hf_config(directory)


def build_model(spec: str, *, seed: int, dtype: torch.dtype, device: str) -> TargetModel:
    """The target model named by ``spec`` on ``device`` (moved per shard later)."""
    directory = model_directory(spec)
    if directory is not None:
        return TargetModel.from_pretrained(directory, dtype=dtype, device=device)
    if spec == "tiny" and device == "cpu":
        # the tiny model's matrices are far too small to share between threads: one
        # thread is several times faster, and immune to other load on the machine
        torch.set_num_threads(1)
    return TargetModel.seeded(model_config(spec), seed=seed, dtype=dtype, device=device)


def tokenizer_for(spec: str) -> TextTokenizer | None:
    """The tokenizer of the model ``spec`` names (None: seeded, or no ``tokenizer.json``)."""
    directory = model_directory(spec)
    if directory is None:
        return None
    try:
        return load_tokenizer(directory)
    except TokenizerError as exc:
        raise SessionError(str(exc)) from None


def eos_for(spec: str) -> int | None:
    """The EOS id of the model ``spec`` names, from its generation_config.json / config.json."""
    directory = model_directory(spec)
    if directory is None:
        return None
    try:
        return eos_token_id(directory)
    except TokenizerError as exc:
        raise SessionError(str(exc)) from None


def parse_ids(text: str, vocab: int, what: str = "--prompt-ids") -> list[int]:
    ids: list[int] = []
    for i, part in enumerate(text.split(",")):
        try:
            tok = int(part.strip())
        except ValueError:
            raise SessionError(
                f"{what} entry {i} must be an integer (got {part.strip()!r})"
            ) from None
        if not 0 <= tok < vocab:
            raise SessionError(f"{what} entry {i} must be a token id in [0, {vocab}) (got {tok})")
        ids.append(tok)
    if not ids:
        raise SessionError(f"{what} must name at least one token id (got {text!r})")
    return ids


def encode_prompt(
    model_spec: str,
    vocab: int,
    *,
    text: str | None,
    ids: str | None,
    length: int | None,
    seed: int,
    allow_bytes: bool = True,
) -> list[int]:
    """Prompt ids from exactly one of ``ids``, ``length`` (seeded random) or ``text``.

    Text goes through the model's ``tokenizer.json``; a model without one encodes UTF-8
    bytes as ids when ``allow_bytes``, else the text is refused.
    """
    given = [
        n
        for n, v in (("--prompt", text), ("--prompt-ids", ids), ("--prompt-len", length))
        if v is not None
    ]
    if len(given) > 1:
        raise SessionError(
            f"give at most one of --prompt, --prompt-ids, --prompt-len (got {given})"
        )
    if ids is not None:
        return parse_ids(ids, vocab)
    if length is not None:
        if length < 1:
            raise SessionError(f"--prompt-len must be >= 1 (got {length})")
        rng = random.Random(seed)
        return [rng.randrange(vocab) for _ in range(length)]
    text = DEFAULT_PROMPT if text is None else text
    if not text:
        raise SessionError("--prompt must not be empty")
    tokenizer = tokenizer_for(model_spec)
    if tokenizer is not None:
        tokens = tokenizer.encode(text)
        if not tokens:
            raise SessionError(f"--prompt {text!r} encodes to no tokens")
        bad = [t for t in tokens if t >= vocab]
        if bad:
            raise SessionError(
                f"the tokenizer {str(tokenizer.path)!r} gives id {bad[0]}, outside the "
                f"model's vocabulary of {vocab} ids"
            )
        return tokens
    if not allow_bytes:
        raise SessionError(
            f"--prompt text needs a tokenizer and model {model_spec!r} has none "
            "(no tokenizer.json); pass --prompt-ids, or --bytes to encode the text as UTF-8 "
            "bytes"
        )
    if vocab < 256:
        raise SessionError(
            f"--prompt text is encoded as UTF-8 bytes, which needs a vocabulary of >= 256 ids "
            f"(this model has {vocab}); pass --prompt-ids"
        )
    return list(text.encode("utf-8"))


def per_slot_probability(drafted_rate: float, block_size: int) -> float:
    """The synthetic drafter's per-slot probability ``p`` giving ``drafted_rate`` on average.

    With slot ``i`` right with probability ``p`` given the earlier ones were, the expected
    accepted share of the ``B-1`` drafted tokens is ``(p + p² + … + p^(B-1)) / (B-1)``,
    increasing in ``p``; solved by bisection.
    """
    if not 0.0 <= drafted_rate <= 1.0:
        raise SessionError(f"--drafted-acceptance must be in [0, 1] (got {drafted_rate})")
    n = block_size - 1

    def rate(p: float) -> float:
        return sum(p**i for i in range(1, n + 1)) / n

    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if rate(mid) < drafted_rate else (lo, mid)
    return (lo + hi) / 2


def is_default_target(model_spec: str | None) -> bool:
    """``--model`` names the default target: ``default``, or the directory the installed
    default target lives in (by any path to it)."""
    if model_spec == DEFAULT_MODEL:
        return True
    if model_spec is None or model_spec in SEEDED_MODELS:
        return False
    target = default_dir("target")
    try:
        return Path(model_spec).is_dir() and target.is_dir() and target.samefile(model_spec)
    except OSError:  # unreadable or vanished paths name no default target
        return False


def build_drafter(
    spec: str,
    model: TargetModel,
    prompt: Sequence[int],
    *,
    plan: ShardPlan,
    acceptance: float,
    seed: int,
    max_new_tokens: int,
    block_size: int,
    model_spec: str | None = None,
) -> tuple[Drafter, list[int] | None]:
    """The drafter, and for ``synthetic`` the target-only greedy tokens it was given.

    ``dflash`` with the default target — ``model_spec`` ``"default"``, or the installed
    default target's directory — is the shipped trained drafter; with any other target it
    is a seeded drafter of the target's shape. ``dflash+lookup`` is the same drafter
    assisted by prompt lookup.
    """
    if spec in ("dflash", "dflash" + LOOKUP_SUFFIX) and is_default_target(model_spec):
        try:
            directory = require_default("drafter")
        except DefaultDataMissingError as exc:
            raise SessionError(f"--draft {spec} with --model default: {exc}") from None
        shipped = str(directory) + spec[len("dflash") :]
        return make_drafter(shipped, model, seed=seed), None
    if spec != "synthetic":
        return make_drafter(spec, model, seed=seed), None
    oracle = reference_greedy(model, plan, prompt, max_new_tokens + block_size)
    drafter = make_drafter(
        "synthetic", model, seed=seed, oracle=list(prompt) + oracle, acceptance=acceptance
    )
    return drafter, oracle[:max_new_tokens]
