"""Where a step's guesses come from: the drafter on the host, or on the device.

One :class:`DraftSource` is chosen when a :class:`~dflash.execution.engine.SpecDecoder` is
built (:func:`draft_source`) and the step sees only its three calls, in data order:

- ``take(context, last)`` → the ``B-1`` guesses for this step, and the drafter's
  probability of each when it reports them (a :class:`ScoredDrafter` on the host);
- ``enqueue_next(taps, count, t)`` → the next step's guesses as a device tensor that the
  step's one read-back brings home, or None (the host proposes next step);
- ``committed(taps, commit_n, read_tail)`` → after the read-back: the committed rows'
  features (host) or the guesses the device made (device).

Tree steps draft on the device too, when the drafter can (:func:`draft_source` with
``tree_candidates``): each device proposal then carries every guess slot's best tokens
with their log-probabilities, read back with the step's tokens, and the tree grows from
them on the host (:meth:`DeviceDrafts.candidates`) with no host proposal and no second
read.

Every guess is checked before it reaches a verify: a list of ``B-1`` token ids in the
vocabulary, confidences ``None`` or ``B-1`` probabilities; a drafter that breaks either
rule is an :class:`ExecutionError` naming it, and the step never runs on its draft.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch
from torch import Tensor

from dflash.execution.errors import ExecutionError
from dflash.execution.shards import ShardedTarget
from dflash.execution.window import is_confidence
from dflash.model.drafters import (
    DeviceCandidateDrafter,
    DeviceDrafter,
    DFlash2Drafter,
    DFlashDrafter,
    Drafter,
    LookupAssistedDrafter,
    RevisingDrafter,
    ScoredDrafter,
    stack_tap_features,
)
from dflash.model.drafters.dflash_device import split_candidates
from dflash.model.drafters.errors import DraftArgumentError


class DraftSource(Protocol):
    """A step's guesses (see the module docstring)."""

    drafter: Drafter

    def start(self, features: Tensor | None, last: int, at: int = 0, skipped: int = 0) -> None:
        """After a prefill: ``features`` ``[P, taps·H]`` of the prompt's tokens from
        position ``at + skipped`` on (``at`` 0: a new sequence; else it continues the
        ``at`` committed tokens, :meth:`can_continue`; ``skipped`` tokens after them came
        without features, when the rest cover :meth:`feature_rows`), ``last`` pending."""
        ...

    def can_continue(self, committed: int) -> bool:
        """Whether a prefill may continue after the ``committed`` tokens the drafter has
        seen (their features are not computed again)."""
        ...

    def feature_rows(self) -> int | None:
        """The most rows of a prefill's features the drafter reads (its reach, when its
        blocks see only the last committed positions); None: every row."""
        ...

    def take(self, context: Sequence[int], last: int) -> tuple[list[int], list[float] | None]:
        """This step's guesses. ``context``: the engine's committed tokens, its own list,
        read here and never kept: a drafter that reads them is handed a copy (a drafter
        cannot change the engine's context), and a source whose drafter does not read
        them copies nothing (at 131,072 tokens a copy costs about 0.4 ms of every step)."""
        ...

    def enqueue_next(self, taps: dict[int, Tensor], count: Tensor, t: Tensor) -> Tensor | None: ...

    def committed(self, taps: dict[int, Tensor], commit_n: int, tail: list[int]) -> None: ...


class _Checked:
    """The checks every source applies to what its drafter returns."""

    def __init__(self, target: ShardedTarget, drafter: Drafter, block_size: int) -> None:
        self.target, self.drafter, self.block_size = target, drafter, block_size
        self.taps = tuple(drafter.tap_layers)
        self.vocab = target.model.config.vocab_size

    def guesses(self, proposal: object) -> list[int]:
        if not isinstance(proposal, list) or len(proposal) != self.block_size - 1:
            got = len(proposal) if isinstance(proposal, list) else type(proposal).__name__
            raise ExecutionError(
                f"drafter {self.drafter.label!r} must propose block_size-1="
                f"{self.block_size - 1} tokens (got {got})"
            )
        for i, tok in enumerate(proposal):
            if isinstance(tok, bool) or not isinstance(tok, int) or not 0 <= tok < self.vocab:
                raise ExecutionError(
                    f"drafter {self.drafter.label!r} proposal[{i}] must be a token id in "
                    f"[0, {self.vocab}) (got {tok!r})"
                )
        return proposal

    def confidence(self, confidence: object) -> list[float] | None:
        """A scored drafter's probabilities: None, or ``block_size - 1`` floats in [0, 1]."""
        if confidence is None:
            return None
        if not is_confidence(confidence, self.block_size):
            raise ExecutionError(
                f"drafter {self.drafter.label!r} confidence must be None or "
                f"{self.block_size - 1} probabilities in [0, 1], one per guess "
                f"(got {confidence!r})"
            )
        return confidence


class HostDrafts(_Checked):
    """The drafter proposes on the host each step, from the committed rows' features."""

    def __init__(self, target: ShardedTarget, drafter: Drafter, block_size: int) -> None:
        super().__init__(target, drafter, block_size)
        self._features: Tensor | None = None
        # a runtime Protocol check walks the drafter's attributes: once here, not every step
        self._scored = drafter if isinstance(drafter, ScoredDrafter) else None

    def start(self, features: Tensor | None, last: int, at: int = 0, skipped: int = 0) -> None:
        if at and not skipped and self._features is not None and features is not None:
            # the rows of the last step not yet given to the drafter come first
            features = torch.cat([self._features, features])
        self._features = features

    def feature_rows(self) -> int | None:
        return drafter_reach(self.drafter)

    def can_continue(self, committed: int) -> bool:
        return True  # the drafter crops or refuses its own cache (it names why)

    def take(self, context: Sequence[int], last: int) -> tuple[list[int], list[float] | None]:
        proposal = self.drafter.propose(list(context), last, self.block_size, self._features)
        guesses = self.guesses(proposal)
        scored = self._scored
        return guesses, None if scored is None else self.confidence(scored.confidence())

    def enqueue_next(self, taps: dict[int, Tensor], count: Tensor, t: Tensor) -> Tensor | None:
        return None

    def committed(self, taps: dict[int, Tensor], commit_n: int, tail: list[int]) -> None:
        self._features = tap_features(self.target, self.taps, taps, commit_n)


class DeviceDrafts(_Checked):
    """A :class:`DeviceDrafter` on a target with CUDA graphs: each step enqueues the next
    step's proposal on the device (the verify's tap rows, the accepted count and the
    target's tokens never leave it) and reads it back with the step's tokens; a
    :class:`RevisingDrafter` may then replace those guesses on the host."""

    def __init__(self, target: ShardedTarget, drafter: DeviceDrafter, block_size: int,
                 tree_candidates: int = 0) -> None:
        super().__init__(target, drafter, block_size)
        self.device_drafter = drafter
        self._revising = drafter if isinstance(drafter, RevisingDrafter) else None
        self._next: list[int] | None = None
        #: candidates per guess slot each device proposal carries (trees; 0: chains)
        self.tree_candidates = tree_candidates
        self._candidates: list[list[tuple[int, float]]] | None = None
        if isinstance(drafter, DeviceCandidateDrafter):  # a drafter kept from trees: reset
            drafter.use_device_candidates(tree_candidates)
        elif tree_candidates:
            raise ExecutionError(
                f"drafter {drafter.label!r} cannot give tree candidates on the device"
            )

    def start(self, features: Tensor | None, last: int, at: int = 0, skipped: int = 0) -> None:
        """The first proposal now, from the prompt's features (eager); the rest inside the
        steps, replayed from the first shard's graphs."""
        assert features is not None  # a device drafter has taps
        first, drafter = self.target.shards[0], self.device_drafter
        with first.on_device():
            guesses = drafter.start_device(
                features, last, self.capacity, self.block_size, at, skipped
            )
        self._next = [int(g) for g in guesses.tolist()]

    def feature_rows(self) -> int | None:
        return drafter_reach(self.drafter)

    @property
    def capacity(self) -> int:
        """Context positions the device drafter holds: the target's, and a block."""
        return self.target.max_len + self.block_size

    def can_continue(self, committed: int) -> bool:
        return self.device_drafter.can_continue_device(committed, self.capacity,
                                                       self.block_size)

    def take(self, context: Sequence[int], last: int) -> tuple[list[int], list[float] | None]:
        if self._next is None:
            raise ExecutionError("the device drafter has no guesses: prefill() first")
        proposal, self._next = self._next, None
        if self.tree_candidates:
            try:
                proposal, self._candidates = split_candidates(
                    proposal, self.block_size - 1, self.tree_candidates
                )
            except DraftArgumentError as exc:
                raise ExecutionError(f"drafter {self.drafter.label!r}: {exc}") from None
        if self._revising is not None:  # e.g. a copy from the context instead
            proposal = self._revising.revise(list(context), last, proposal)
        return self.guesses(proposal), None

    def candidates(self) -> list[list[tuple[int, float]]]:
        """The last :meth:`take`'s ``tree_candidates`` best tokens per guess slot with
        their log-probabilities, best first (what a tree grows from)."""
        if self._candidates is None:
            raise ExecutionError("no device candidates: take() a proposal drafted for trees")
        return self._candidates

    def enqueue_next(self, taps: dict[int, Tensor], count: Tensor, t: Tensor) -> Tensor | None:
        graphs = self.target.graphs
        assert graphs is not None
        first = self.target.shards[0]
        rows = stack_tap_features({k: v.to(first.device) for k, v in taps.items()}, self.taps)
        drafter = self.device_drafter
        # the drafter's buffers (a new prefill's start) or its sampling rule (``couple``)
        # may have changed since the last step: a graph captured on the old ones is dropped
        graphs[0].bind("draft", (id(drafter), drafter.device_buffers_version))
        with first.on_device():
            drafter.set_device_inputs(rows, count.to(first.device), t.to(first.device))
            out: Tensor = graphs[0].run_static(("draft", self.block_size, False),
                                               drafter.device_step)
        return out

    def committed(self, taps: dict[int, Tensor], commit_n: int, tail: list[int]) -> None:
        self._next = tail


def drafter_reach(drafter: Drafter) -> int | None:
    """How many committed positions before a block ``drafter`` reads (a DFlash drafter's
    :attr:`~dflash.model.drafters.DFlashDrafter.context_reach`, alone or assisted by
    prompt lookup); None: all of them, or a drafter without a reach."""
    inner = drafter.dflash if isinstance(drafter, LookupAssistedDrafter) else drafter
    return inner.context_reach if isinstance(inner, DFlashDrafter) else None


def draft_source(target: ShardedTarget, drafter: Drafter, block_size: int,
                 tree_candidates: int = 0) -> DraftSource:
    """:class:`DeviceDrafts` when the drafter can draft on the device and the target runs
    CUDA graphs, else :class:`HostDrafts`. ``tree_candidates`` (trees): the candidates per
    slot a tree grows from, drafted on the device only by a drafter whose proposals can
    carry them (:class:`DeviceCandidateDrafter`; a DFlash2 drafter's trees come from its
    selector on the host)."""
    device = (target.graphs is not None and bool(drafter.tap_layers)
              and isinstance(drafter, DeviceDrafter))
    if tree_candidates:
        inner = drafter.dflash if isinstance(drafter, LookupAssistedDrafter) else drafter
        device = (device and isinstance(drafter, DeviceCandidateDrafter)
                  and not isinstance(inner, DFlash2Drafter))
    if device:
        assert isinstance(drafter, DeviceDrafter)
        return DeviceDrafts(target, drafter, block_size, tree_candidates)
    if isinstance(drafter, DeviceCandidateDrafter):  # drafted on the host: guesses alone
        drafter.use_device_candidates(0)
    return HostDrafts(target, drafter, block_size)


def tap_features(
    target: ShardedTarget, layers: Sequence[int], taps: dict[int, Tensor], rows: int
) -> Tensor | None:
    """A drafter's features ``[rows, len(layers)·H]`` from a forward's ``taps``, on the first
    shard's device (None for a drafter without tap layers)."""
    if not layers:
        return None
    first = target.shards[0].device
    return stack_tap_features({k: v.to(first) for k, v in taps.items()}, layers)[:rows]


__all__ = [
    "DeviceDrafts",
    "DraftSource",
    "HostDrafts",
    "draft_source",
    "tap_features",
]
