"""The drafter interface shared by every drafter, and the argument checks they all use.

A drafter guesses the tokens that follow ``last``. With ``context`` the committed tokens
(already in the target's caches) and ``last`` the pending token at position
``len(context)``, ``propose`` returns exactly ``block_size - 1`` tokens: the guesses for
slots ``1 .. block_size-1`` of the draft block ``[last, guess_1, ..., guess_{B-1}]``.

Drafters that condition on the target (``tap_layers`` non-empty) take ``features``: the
hidden states of the last ``T <= len(context)`` committed tokens at the tap layers,
concatenated along the last axis in ``tap_layers`` order, shape ``[T, len(tap_layers) * H]``.
:func:`stack_tap_features` builds that from the ``{layer: hidden}`` dict the target returns.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor

from dflash.model.drafters.errors import DraftArgumentError
from dflash.sampling import SamplingParams


@runtime_checkable
class Drafter(Protocol):
    """Proposes ``block_size - 1`` tokens after ``last``; see the module docstring."""

    @property
    def label(self) -> str:
        """Short name shown in results and reports (``"dflash"``, ``"prompt-lookup"``...)."""
        ...

    @property
    def tap_layers(self) -> tuple[int, ...]:
        """Target layers whose hidden states ``propose`` needs; empty: pass ``features=None``."""
        ...

    def propose(
        self, context: list[int], last: int, block_size: int, features: Tensor | None
    ) -> list[int]:
        """Return exactly ``block_size - 1`` guessed tokens following ``last``."""
        ...


@runtime_checkable
class ScoredDrafter(Drafter, Protocol):
    """A drafter that also says how sure it is of its last proposal.

    ``confidence()`` is the probability the drafter gave each guess of its most recent
    ``propose`` (``block_size - 1`` floats in [0, 1], in guess order), or None when it has
    none (nothing proposed since the last reset, or the last guesses came from the device).
    On CPU the engine verifies only the guesses whose expected acceptance pays for their
    verify (:func:`dflash.model.tiles.tile_window`); the emitted tokens do not depend on it.
    """

    def confidence(self) -> list[float] | None: ...


@runtime_checkable
class CoupledDrafter(Drafter, Protocol):
    """A drafter that can draw its guesses by the target's sampling rule and noise
    (coupled drafting: a guess at position ``p`` is ``argmax(draft_logits / T + G(seed,
    p))``, so a drafter whose distribution equals the target's is always accepted)."""

    def couple(self, sampling: SamplingParams) -> None: ...


@runtime_checkable
class DeviceDrafter(Drafter, Protocol):
    """A drafter that can also draft on the device: after ``start_device`` (the prompt's
    tap rows), each step's inputs stay on the device (``set_device_inputs``: the verify's
    tap rows, the accepted count, the target's tokens) and ``device_step`` — capture-safe
    device work over static buffers — returns the next ``[B-1]`` guesses as a tensor. The
    engine uses it when the target runs CUDA graphs, and captures ``device_step`` too."""

    @property
    def device_buffers_version(self) -> int:
        """Changes when the static buffers are allocated anew (the engine rebinds the
        drafter's captured step then); read only."""
        ...

    def start_device(
        self, features: Tensor, last: int, capacity: int, block_size: int, start: int = 0,
        skipped: int = 0,
    ) -> Tensor: ...

    def can_continue_device(self, committed: int, capacity: int, block_size: int) -> bool:
        """Whether ``start_device(..., start=committed)`` can continue the context held on
        the device (its buffers fit and hold exactly ``committed`` positions)."""
        ...

    def set_device_inputs(self, rows: Tensor, commit_n: Tensor, tokens: Tensor) -> None: ...

    def device_step(self) -> Tensor: ...


@runtime_checkable
class DeviceCandidateDrafter(DeviceDrafter, Protocol):
    """A device drafter whose proposals can also carry each guess slot's ``k`` best tokens
    with their log-probabilities (``use_device_candidates(k)``; the layout of
    :func:`~dflash.model.drafters.dflash_device.split_candidates`), so a tree grows from
    the step's one read-back (the engine's tree steps on CUDA graphs)."""

    def use_device_candidates(self, k: int) -> None: ...


@runtime_checkable
class RevisingDrafter(DeviceDrafter, Protocol):
    """A device drafter whose guesses the host may replace: after the step's one read-back
    the engine hands ``revise`` the guesses the device made for the next step, with the
    committed ``context`` and the pending ``last`` token, and verifies the ``B-1`` tokens
    it returns instead (:class:`~dflash.model.drafters.lookup_assisted.
    LookupAssistedDrafter`: a copy from the context when it starts with the device's first
    guess)."""

    def revise(self, context: list[int], last: int, guesses: list[int]) -> list[int]: ...


def check_block_size(block_size: object) -> int:
    """``block_size`` must be an int >= 2 (a block is ``last`` plus at least one guess)."""
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 2:
        raise DraftArgumentError(f"'block_size' must be an int >= 2 (got {block_size!r})")
    return block_size


def check_token(name: str, token: object, vocab_size: int | None = None) -> int:
    """A token id is an int >= 0 and, when the vocabulary is known, < ``vocab_size``."""
    if isinstance(token, bool) or not isinstance(token, int) or token < 0:
        raise DraftArgumentError(f"{name!r} must be a token id, an int >= 0 (got {token!r})")
    if vocab_size is not None and token >= vocab_size:
        raise DraftArgumentError(f"{name!r} must be < vocab_size={vocab_size} (got {token})")
    return token


def check_context(
    context: object, vocab_size: int | None = None, *, check_tokens: bool = True
) -> list[int]:
    """``context`` is a list/tuple of token ids; the first bad entry is named in the error.

    ``check_tokens=False`` checks only the container (for drafters that read only its length).
    """
    if not isinstance(context, (list, tuple)):
        raise DraftArgumentError(
            f"'context' must be a list of token ids (got {type(context).__name__})"
        )
    if not check_tokens:
        return list(context)
    for i, token in enumerate(context):
        check_token(f"context[{i}]", token, vocab_size)
    return list(context)


def stack_tap_features(hidden_by_layer: Mapping[int, Tensor], tap_layers: Sequence[int]) -> Tensor:
    """Concatenate tap hidden states into the drafter's ``features`` layout.

    Args:
        hidden_by_layer: ``{layer_id: hidden}`` with ``hidden`` of shape ``[T, H]`` or
            ``[1, T, H]`` (batch 1), as returned by the target's ``run_layers``.
        tap_layers: the drafter's ``tap_layers``; fixes the concatenation order.

    Returns:
        ``[T, len(tap_layers) * H]``.
    """
    missing = [layer for layer in tap_layers if layer not in hidden_by_layer]
    if missing:
        raise DraftArgumentError(
            f"'hidden_by_layer' lacks tap layers {missing} (has {sorted(hidden_by_layer)})"
        )
    parts: list[Tensor] = []
    for layer in tap_layers:
        hidden = hidden_by_layer[layer]
        if hidden.dim() == 3 and hidden.shape[0] == 1:
            hidden = hidden[0]
        if hidden.dim() != 2:
            raise DraftArgumentError(
                f"tap layer {layer} hidden must be [T, H] or [1, T, H] (got {list(hidden.shape)})"
            )
        if parts and hidden.shape != parts[0].shape:
            raise DraftArgumentError(
                f"tap layer {layer} hidden has shape {list(hidden.shape)}, "
                f"tap layer {tap_layers[0]} has {list(parts[0].shape)}"
            )
        parts.append(hidden)
    return torch.cat(parts, dim=-1)
