"""Building what a generation needs from command-line style names.

- models: ``tiny`` (the built-in default: :meth:`TargetModel.tiny_default` shape, seeded),
  ``nine-b-shape`` (seeded weights in the shape of Qwen3.5-9B, for benchmarks), or a
  Hugging Face checkpoint directory;
- drafters: ``dflash`` (the built-in default: a seeded DFlash block drafter),
  ``prompt-lookup``, ``synthetic`` (SYNTHETIC acceptance profile; needs the target's own
  greedy continuation, computed here), or a DFlash drafter checkpoint directory;
- prompts: explicit ids, text (the model directory's tokenizer when it has one and
  ``transformers`` is installed, else UTF-8 bytes as ids), or ``N`` seeded random ids.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path

import torch

from dflash.execution.oracle import reference_greedy
from dflash.execution.shards import ShardPlan
from dflash.model import HybridConfig, TargetModel
from dflash.model.drafters import Drafter, make_drafter

BUILTIN_MODELS = ("tiny", "nine-b-shape")
DEFAULT_PROMPT = (
    "Speculative decoding drafts a block of tokens; the target verifies them all at once."
)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class SessionError(ValueError):
    """A model, drafter, dtype or prompt argument that cannot be used; names the value."""


def parse_dtype(name: str | None, model: str, device: str) -> torch.dtype:
    if name is None:
        big = model != "tiny" and device.startswith("cuda")
        return torch.bfloat16 if big else torch.float32
    if name not in DTYPES:
        raise SessionError(f"--dtype must be one of {', '.join(DTYPES)} (got {name!r})")
    return DTYPES[name]


def model_config(spec: str) -> HybridConfig:
    """The configuration of the model named by ``spec``, without building any weights."""
    if spec == "tiny":
        return HybridConfig.tiny_default()
    if spec == "nine-b-shape":
        return HybridConfig.nine_b_shape()
    if Path(spec).is_dir():
        return HybridConfig.from_hf_config(spec)
    raise SessionError(
        f"--model must be one of {', '.join(BUILTIN_MODELS)} or a checkpoint directory "
        f"(got {spec!r}: no such directory)"
    )


def build_model(spec: str, *, seed: int, dtype: torch.dtype, device: str) -> TargetModel:
    """The target model named by ``spec`` on ``device`` (moved per shard later)."""
    config = model_config(spec)
    if spec not in BUILTIN_MODELS:
        return TargetModel.from_pretrained(spec, dtype=dtype, device=device)
    if spec == "tiny" and device == "cpu":
        # the tiny model's matrices are far too small to share between threads: one
        # thread is several times faster, and immune to other load on the machine
        torch.set_num_threads(1)
    return TargetModel.seeded(config, seed=seed, dtype=dtype, device=device)


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
) -> list[int]:
    """Prompt ids from exactly one of ``ids``, ``length`` (seeded random) or ``text``."""
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
    directory = Path(model_spec)
    if directory.is_dir() and (directory / "tokenizer.json").exists():
        try:
            from transformers import AutoTokenizer
        except ImportError:
            raise SessionError(
                f"--prompt needs the tokenizer of {model_spec!r}: install transformers, or "
                "pass --prompt-ids"
            ) from None
        tokens: list[int] = AutoTokenizer.from_pretrained(str(directory)).encode(text)
        return tokens
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
    deterministic: bool,
) -> tuple[Drafter, list[int] | None]:
    """The drafter, and for ``synthetic`` the target-only greedy tokens it was given."""
    if spec != "synthetic":
        return make_drafter(spec, model, seed=seed), None
    oracle = reference_greedy(
        model,
        plan,
        prompt,
        max_new_tokens + block_size,
        deterministic=deterministic,
        block_size=block_size,
    )
    drafter = make_drafter(
        "synthetic", model, seed=seed, oracle=list(prompt) + oracle, acceptance=acceptance
    )
    return drafter, oracle[:max_new_tokens]
