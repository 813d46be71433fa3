"""Building what a generation needs from names, for the library and the command line.

- models: see :mod:`dflash.model.catalog` (``default``, the seeded ``tiny``,
  ``nine-b-shape``, ``twenty-seven-b-shape``, or a checkpoint directory);
- drafters: ``dflash`` (with ``--model default`` the shipped trained drafter, else a seeded
  DFlash block drafter shaped for the target), ``prompt-lookup``, ``synthetic`` (SYNTHETIC
  acceptance profile; needs the target's own greedy continuation, computed here), or a
  DFlash drafter checkpoint directory; ``+lookup`` after a DFlash spec (``dflash+lookup``,
  ``DIR+lookup``): that drafter assisted by prompt lookup;
- prompts: explicit ids, text (the model directory's ``tokenizer.json``; a model without
  one encodes UTF-8 bytes as ids when ``allow_bytes``), or ``N`` seeded random ids.

Messages name the library's parameters (``'dtype' must be one of ...``); the command line
spells them as its flags through :meth:`dflash.errors.UsageError.worded`. Nothing here
changes global torch settings.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

import torch

from dflash.data import DefaultDataMissingError, default_dir, require_default
from dflash.errors import param
from dflash.execution.oracle import reference_greedy
from dflash.execution.shards import DEFAULT_PREFILL_CHUNK, ShardPlan
from dflash.model import TargetModel
from dflash.model.catalog import BUILTIN_MODELS as BUILTIN_MODELS
from dflash.model.catalog import DEFAULT_MODEL as DEFAULT_MODEL
from dflash.model.catalog import SEEDED_MODELS as SEEDED_MODELS
from dflash.model.catalog import SessionError as SessionError
from dflash.model.catalog import build_model as build_model
from dflash.model.catalog import model_config as model_config
from dflash.model.catalog import model_directory as model_directory
from dflash.model.drafters import (
    LOOKUP_SUFFIX,
    DFlashDrafter,
    Drafter,
    LookupAssistedDrafter,
    make_drafter,
)
from dflash.model.drafters.errors import DraftArgumentError
from dflash.model.drafters.trees import SyntheticTreeDrafter
from dflash.model.tokenizer import (
    TextTokenizer,
    TokenizerError,
    eos_token_ids,
    load_tokenizer,
    require_utf8,
)
from dflash.sampling import GREEDY, SamplingParams

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_dtype(name: str | None, model: str, device: str) -> torch.dtype:
    """The ``dtype`` argument; by default float32 for ``tiny`` or on CPU, else bfloat16."""
    if name is None:
        big = model != "tiny" and device.startswith("cuda")
        return torch.bfloat16 if big else torch.float32
    if not isinstance(name, str) or name not in DTYPES:
        raise SessionError(
            f"{param('dtype')} must be one of {', '.join(DTYPES)} (got {name!r})"
        )
    return DTYPES[name]


def tokenizer_for(spec: str) -> TextTokenizer | None:
    """The tokenizer of the model ``spec`` names (None: seeded, or no ``tokenizer.json``)."""
    directory = model_directory(spec)
    if directory is None:
        return None
    try:
        return load_tokenizer(directory)
    except TokenizerError as exc:
        raise SessionError(str(exc)) from None


def eos_for(spec: str) -> tuple[int, ...]:
    """The EOS ids of the model ``spec`` names, from its generation_config.json /
    config.json (empty: none)."""
    directory = model_directory(spec)
    if directory is None:
        return ()
    try:
        return eos_token_ids(directory)
    except TokenizerError as exc:
        raise SessionError(str(exc)) from None


def parse_ids(text: str, vocab: int, what: str = "prompt_ids") -> list[int]:
    """Comma-separated token ids; messages name the parameter ``what``."""
    ids: list[int] = []
    for i, part in enumerate(text.split(",")):
        try:
            tok = int(part.strip())
        except ValueError:
            raise SessionError(
                f"{param(what)} entry {i} must be an integer (got {part.strip()!r})"
            ) from None
        if not 0 <= tok < vocab:
            raise SessionError(
                f"{param(what)} entry {i} must be a token id in [0, {vocab}) (got {tok})"
            )
        ids.append(tok)
    if not ids:
        raise SessionError(f"{param(what)} must name at least one token id (got {text!r})")
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
    bytes as ids when ``allow_bytes`` (the parameter ``'bytes'`` in messages), else the
    text is refused. Text that is not valid UTF-8 (lone surrogates, as undecodable bytes
    of a command line become) is refused naming the first bad byte.
    """
    params = ("prompt", "prompt_ids", "prompt_len")
    given = [p for p, v in zip(params, (text, ids, length), strict=True) if v is not None]
    if len(given) != 1:
        raise SessionError(
            f"give exactly one of {', '.join(map(param, params))} "
            f"(got {', '.join(map(param, given)) or 'none'})"
        )
    if ids is not None:
        return parse_ids(ids, vocab)
    if length is not None:
        if length < 1:
            raise SessionError(f"{param('prompt_len')} must be >= 1 (got {length})")
        rng = random.Random(seed)
        return [rng.randrange(vocab) for _ in range(length)]
    assert text is not None  # exactly one of the three was given
    if not text:
        raise SessionError(f"{param('prompt')} must not be empty")
    require_utf8(text, "prompt")
    tokenizer = tokenizer_for(model_spec)
    if tokenizer is not None:
        tokens = tokenizer.encode(text)
        if not tokens:
            raise SessionError(f"{param('prompt')} {text!r} encodes to no tokens")
        bad = [t for t in tokens if t >= vocab]
        if bad:
            raise SessionError(
                f"the tokenizer {str(tokenizer.path)!r} gives id {bad[0]}, outside the "
                f"model's vocabulary of {vocab} ids"
            )
        return tokens
    if not allow_bytes:
        raise SessionError(
            f"{param('prompt')} text needs a tokenizer and model {model_spec!r} has none "
            f"(no tokenizer.json); pass {param('prompt_ids')}, or {param('bytes')} to encode "
            "the text as UTF-8 bytes"
        )
    if vocab < 256:
        raise SessionError(
            f"{param('prompt')} text is encoded as UTF-8 bytes, which needs a vocabulary "
            f"of >= 256 ids (this model has {vocab}); pass {param('prompt_ids')}"
        )
    return list(text.encode("utf-8"))


def per_slot_probability(drafted_rate: float, block_size: int) -> float:
    """The synthetic drafter's per-slot probability ``p`` giving ``drafted_rate`` on average.

    With slot ``i`` right with probability ``p`` given the earlier ones were, the expected
    accepted share of the ``B-1`` drafted tokens is ``(p + p² + … + p^(B-1)) / (B-1)``,
    increasing in ``p``; solved by bisection.
    """
    if not 0.0 <= drafted_rate <= 1.0:
        raise SessionError(
            f"{param('drafted_acceptance')} must be in [0, 1] (got {drafted_rate})"
        )
    n = block_size - 1

    def rate(p: float) -> float:
        return sum(p**i for i in range(1, n + 1)) / n

    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if rate(mid) < drafted_rate else (lo, mid)
    return (lo + hi) / 2


def is_default_target(model_spec: str | None) -> bool:
    """``model_spec`` names the default target: ``default``, or the directory the installed
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
    draft_dtype: torch.dtype | None = None,
    tree_budget: int | None = None,
    sampling: SamplingParams = GREEDY,
    prefill_chunk: int | None = DEFAULT_PREFILL_CHUNK,
    draft_window: int | None = None,
) -> tuple[Drafter, list[int] | None]:
    """The drafter, and for ``synthetic`` the target-only greedy tokens it was given.

    ``dflash`` with the default target — ``model_spec`` ``"default"``, or the installed
    default target's directory — is the shipped trained drafter; with any other target it
    is a seeded drafter of the target's shape. ``dflash+lookup`` is the same drafter
    assisted by prompt lookup. ``draft_dtype``: the DFlash drafter's parameter dtype
    (None: :func:`make_drafter`'s default). ``tree_budget`` with ``synthetic``: the
    SYNTHETIC tree drafter (:func:`tree_rank_probs` of ``acceptance``) instead.
    ``prefill_chunk``: the runs' prefill chunks (the synthetic drafter's plain decode
    prefills as they do, so its tokens are theirs). ``draft_window``: a DFlash drafter's
    :attr:`~dflash.model.drafters.DFlashDrafter.context_window` (refused for the others).
    """
    drafter, oracle = _drafter(spec, model, prompt, plan=plan, acceptance=acceptance,
                               seed=seed, max_new_tokens=max_new_tokens,
                               block_size=block_size, model_spec=model_spec,
                               draft_dtype=draft_dtype, tree_budget=tree_budget,
                               sampling=sampling, prefill_chunk=prefill_chunk)
    if draft_dtype is not None and not isinstance(_dflash_of(drafter), DFlashDrafter):
        raise SessionError(
            f"{param('draft_dtype')}={str(draft_dtype).removeprefix('torch.')} applies to "
            f"DFlash drafters (the drafter is {drafter.label!r}): it sets the dtype of "
            "their products"
        )
    set_draft_window(drafter, draft_window)
    return drafter, oracle


def _dflash_of(drafter: Drafter) -> object:
    """The DFlash drafter inside ``drafter`` (itself, or the one prompt lookup assists)."""
    return drafter.dflash if isinstance(drafter, LookupAssistedDrafter) else drafter


def set_draft_window(drafter: Drafter, window: int | None) -> None:
    """Give a DFlash drafter (alone or assisted by prompt lookup) the context window
    ``window``; None leaves every drafter as it is; a window for another drafter is a
    :class:`SessionError` naming it."""
    if window is None:
        return
    inner = _dflash_of(drafter)
    if not isinstance(inner, DFlashDrafter):
        raise SessionError(
            f"{param('draft_window')}={window} applies to DFlash drafters (the drafter is "
            f"{drafter.label!r}): it bounds the context a DFlash block attends"
        )
    try:
        inner.context_window = window
    except DraftArgumentError as exc:
        raise SessionError(f"{param('draft_window')}: {exc}") from None


def _drafter(
    spec: str,
    model: TargetModel,
    prompt: Sequence[int],
    *,
    plan: ShardPlan,
    acceptance: float,
    seed: int,
    max_new_tokens: int,
    block_size: int,
    model_spec: str | None,
    draft_dtype: torch.dtype | None,
    tree_budget: int | None,
    sampling: SamplingParams,
    prefill_chunk: int | None,
) -> tuple[Drafter, list[int] | None]:
    """:func:`build_drafter` without the window."""
    extra: dict[str, Any] = {} if draft_dtype is None else {"draft_dtype": draft_dtype}
    if spec in ("dflash", "dflash" + LOOKUP_SUFFIX) and is_default_target(model_spec):
        try:
            directory = require_default("drafter")
        except DefaultDataMissingError as exc:
            raise SessionError(
                f"{param('draft')} {spec} with {param('model')} default: {exc}"
            ) from None
        shipped = str(directory) + spec[len("dflash") :]
        return make_drafter(shipped, model, seed=seed, **extra), None
    if spec != "synthetic":
        return make_drafter(spec, model, seed=seed, **extra), None
    oracle = reference_greedy(  # the tokens the target draws under the sampling rule
        model, plan, prompt, max_new_tokens + max(block_size, tree_budget or 0),
        sampling=sampling, prefill_chunk=prefill_chunk,
    )
    if tree_budget is not None:
        tree = SyntheticTreeDrafter(
            list(prompt) + oracle, tree_rank_probs(acceptance), model.config.vocab_size,
            seed=seed,
        )
        return cast(Drafter, tree), oracle[:max_new_tokens]
    drafter = make_drafter(
        "synthetic", model, seed=seed, oracle=list(prompt) + oracle, acceptance=acceptance
    )
    return drafter, oracle[:max_new_tokens]


#: ranks of a synthetic tree drafter's candidates
TREE_RANKS = 4


def tree_rank_probs(acceptance: float) -> tuple[float, ...]:
    """The SYNTHETIC tree drafter's rank distribution for a per-slot ``acceptance`` ``a``:
    the target's token is the rank-``r`` candidate with probability ``a (1-a)^r``, ``r <``
    :data:`TREE_RANKS` (rank 0 is the chain drafter's guess, right with probability
    ``a``; each further rank catches ``a`` of what is left), absent otherwise."""
    if not 0.0 < acceptance < 1.0:
        raise SessionError(
            f"{param('acceptance')} must be in (0, 1) for a tree drafter (got {acceptance})"
        )
    return tuple(acceptance * (1.0 - acceptance) ** r for r in range(TREE_RANKS))
