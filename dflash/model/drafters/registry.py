"""``make_drafter``: build a drafter from a spec string (the ``--draft`` argument).

Specs: ``"prompt-lookup"``, ``"synthetic"`` (needs ``oracle``), ``"dflash"`` (a seeded random
DFlash drafter shaped for the target — the built-in default, untrained) or a directory
holding a DFlash drafter checkpoint in z-lab's format (``config.json`` +
``model.safetensors``, as published for vLLM / SGLang). Names win over directories; write
``./dflash`` to load a directory of that name. A DFlash spec followed by ``+lookup``
(``"dflash+lookup"``, ``"DIR+lookup"``) is that drafter assisted by prompt lookup
(:class:`~dflash.model.drafters.lookup_assisted.LookupAssistedDrafter`); a directory
whose name itself ends in ``+lookup`` is named with a trailing ``/``.
"""

from __future__ import annotations

from collections.abc import Sequence, Sized
from pathlib import Path
from typing import Protocol

import torch
from torch import Tensor

from dflash.errors import param
from dflash.model.drafters.base import Drafter
from dflash.model.drafters.dflash_config import DFlashConfig
from dflash.model.drafters.dflash_drafter import DFlashDrafter, check_draft_dtype
from dflash.model.drafters.errors import DraftArgumentError, UnknownDrafterSpecError
from dflash.model.drafters.lookup_assisted import LookupAssistedDrafter
from dflash.model.drafters.prompt_lookup import PromptLookupDrafter
from dflash.model.drafters.synthetic import Oracle, SyntheticDrafter

DRAFTER_NAMES = ("dflash", "dflash+lookup", "prompt-lookup", "synthetic")
LOOKUP_SUFFIX = "+lookup"  # a DFlash spec with it: that drafter assisted by prompt lookup


class _HasWeight(Protocol):
    @property
    def weight(self) -> Tensor: ...


class DraftTarget(Protocol):
    """What drafters need from a target model (``TargetModel`` has all of it)."""

    @property
    def embed_tokens(self) -> _HasWeight: ...

    def head_weight(self) -> Tensor:
        """The LM head's weight, dense (an FP8 head dequantized)."""
        ...

    @property
    def layers(self) -> Sized: ...


def make_drafter(
    spec: str,
    target: DraftTarget,
    *,
    seed: int = 0,
    oracle: Oracle | None = None,
    acceptance: float | Sequence[float] = 0.8,
    dtype: torch.dtype | None = None,
    draft_dtype: torch.dtype | None = None,
) -> Drafter:
    """Build the drafter named by ``spec`` for ``target``.

    Args:
        spec: a name in :data:`DRAFTER_NAMES`, a DFlash drafter checkpoint directory, or
            either DFlash spec followed by :data:`LOOKUP_SUFFIX`.
        target: supplies the shared embedding / LM head and the layer count.
        seed: seeds the random ``"dflash"`` drafter and the ``"synthetic"`` drafter.
        oracle: ``"synthetic"`` only: the target's greedy sequence or next-token callable.
        acceptance: ``"synthetic"`` only: one per-slot probability, or a per-slot profile.
        dtype: DFlash drafters only: parameter dtype (default: the embedding's).
        draft_dtype: DFlash drafters only: the dtype their products multiply in (default
            None: the weights' own). Only guesses come out of a drafter, so any of
            ``DRAFT_DTYPES`` leaves the output lossless; the target verifies every guess.

    Raises:
        DraftArgumentError: ``draft_dtype`` is not None or a floating dtype of
            ``DRAFT_DTYPES`` (checked for every spec).
    """
    if not isinstance(spec, str) or not spec:
        raise UnknownDrafterSpecError(
            f"{param('draft')} must be a non-empty string (got {spec!r})"
        )
    check_draft_dtype(draft_dtype)
    if spec.endswith(LOOKUP_SUFFIX):
        inner = spec[: -len(LOOKUP_SUFFIX)]
        if inner in ("prompt-lookup", "synthetic") or not inner:
            raise UnknownDrafterSpecError(
                f"unknown drafter spec {spec!r}: {LOOKUP_SUFFIX!r} follows a DFlash drafter "
                f"('dflash' or a DFlash drafter checkpoint directory)"
            )
        try:
            dflash = make_drafter(inner, target, seed=seed, dtype=dtype, draft_dtype=draft_dtype)
        except UnknownDrafterSpecError as exc:
            raise UnknownDrafterSpecError(f"drafter spec {spec!r}: {exc}") from None
        assert isinstance(dflash, DFlashDrafter)  # the inner spec names a DFlash drafter
        return LookupAssistedDrafter(dflash)
    embed = target.embed_tokens.weight  # [V, H]
    lm_head = target.head_weight()  # [V, H] (an FP8 head: dequantized)
    if spec == "prompt-lookup":
        return PromptLookupDrafter()
    if spec == "synthetic":
        if oracle is None:
            raise DraftArgumentError(
                "'oracle' is required for spec 'synthetic' (the target's greedy continuation)"
            )
        vocab = int(lm_head.shape[0])
        if isinstance(acceptance, Sequence):
            return SyntheticDrafter.from_profile(oracle, acceptance, vocab, seed)
        return SyntheticDrafter(oracle, acceptance, vocab, seed)
    if spec == "dflash":
        config = DFlashConfig.for_target(
            hidden_size=int(embed.shape[1]),
            vocab_size=int(embed.shape[0]),
            num_target_layers=len(target.layers),
            num_hidden_layers=2,
        )
        return DFlashDrafter.random(
            config, embed, lm_head, seed, dtype=dtype, draft_dtype=draft_dtype
        )
    if Path(spec).is_dir():
        return DFlashDrafter.from_pretrained(
            spec, embed, lm_head, num_target_layers=len(target.layers), dtype=dtype,
            draft_dtype=draft_dtype,
        )
    raise UnknownDrafterSpecError(
        f"unknown drafter spec {spec!r}: expected one of {list(DRAFTER_NAMES)} "
        f"or an existing DFlash drafter checkpoint directory"
    )
