"""The DFlash drafter assisted by prompt lookup: a copy from the context replaces the block
draft when the copy starts with the DFlash drafter's own first guess.

Generated code repeats itself (a signature, a docstring, a run of similar lines). A block
drafter predicts well only a few tokens ahead; a copy of the text that followed an earlier
occurrence of the context's suffix can be right for the whole block. Each step:

1. the DFlash drafter proposes (so its context cache stays current whichever draft is used);
2. :class:`~dflash.model.drafters.prompt_lookup.PromptLookupDrafter` looks for the most
   recent earlier occurrence of the suffix of ``context + [last]``;
3. when it found one and the copy's first token is the DFlash drafter's first guess — the
   drafter, which sees the target's features, corroborates the copy — the draft is the
   copy; otherwise it is the DFlash drafter's.

Either way the target verifies the draft, so the output is the target's greedy output.

Confidence (what the CPU verify window is cut by, :class:`~dflash.model.drafters.base.
ScoredDrafter`): a DFlash draft keeps the drafter's probabilities. Guess ``i`` of a copied
draft gets ``max(p_i, q)``: ``p_i`` the probability the DFlash drafter gave that token in
slot ``i``, ``q`` the copies' acceptance so far in this generation, ``(accepted + 1) /
(accepted + rejected + 2)`` over the copied guesses whose fate the next step shows (the
target's token after an accepted prefix that equals the next guess means that guess was
right but not verified: it counts neither way).

Drafting on the device (a target running CUDA graphs) is the DFlash drafter's own, and the
engine hands the guesses it read back to :meth:`revise`, which applies the same rule: the
next step verifies the copy instead when it starts with the device's first guess (on the
device every step verifies the whole block, so no confidence is needed there).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from dflash.model.drafters.base import check_block_size, check_token
from dflash.model.drafters.dflash_drafter import DFlashDrafter
from dflash.model.drafters.errors import DraftArgumentError
from dflash.model.drafters.prompt_lookup import PromptLookupDrafter
from dflash.sampling import SamplingParams


@dataclass(frozen=True, slots=True)
class _Copied:
    """A copied draft awaiting its outcome: proposed at context length ``at`` after
    ``last``."""

    at: int
    last: int
    guesses: tuple[int, ...]


class LookupAssistedDrafter:
    """:class:`DFlashDrafter` whose draft is a context copy when the two agree (see the
    module docstring)."""

    def __init__(self, dflash: DFlashDrafter, lookup: PromptLookupDrafter | None = None) -> None:
        if not isinstance(dflash, DFlashDrafter):
            raise DraftArgumentError(
                f"'dflash' must be a DFlashDrafter (got {type(dflash).__name__})"
            )
        if lookup is not None and not isinstance(lookup, PromptLookupDrafter):
            raise DraftArgumentError(
                f"'lookup' must be None or a PromptLookupDrafter (got {type(lookup).__name__})"
            )
        self.dflash = dflash
        self.lookup = lookup if lookup is not None else PromptLookupDrafter()
        self.label = f"{dflash.label}+lookup"
        self._confidence: list[float] | None = None
        self._copy: list[int] | None = None  # the last proposal's context copy, if any
        self._new_generation()

    def _new_generation(self) -> None:
        self.drafts = 0  # drafts made in this generation (host proposals and revisions)
        self.copied_drafts = 0  # of which copies
        self.accepted = 0  # copied guesses accepted
        self.rejected = 0  # copied guesses rejected
        self._pending: _Copied | None = None

    @property
    def tap_layers(self) -> tuple[int, ...]:
        return self.dflash.tap_layers

    @property
    def copy_acceptance(self) -> float:
        """``q``: the copies' acceptance so far in this generation (1/2 before any)."""
        return (self.accepted + 1) / (self.accepted + self.rejected + 2)

    def reset(self) -> None:
        """Forget the cached context and this generation's counts."""
        self.dflash.reset()
        self._confidence = None
        self._new_generation()

    def couple(self, sampling: SamplingParams) -> None:
        """The DFlash drafter's guesses drawn by the target's rule
        (:meth:`DFlashDrafter.couple`); a copy from the context stays a copy."""
        self.dflash.couple(sampling)

    def candidates(self, k: int) -> list[list[tuple[int, float]]]:
        """The DFlash drafter's per-slot candidates of the last proposal (a tree grows from
        them, :class:`~dflash.model.drafters.trees.CandidateDrafter`)."""
        return self.dflash.candidates(k)

    def tree_branch(self) -> list[int] | None:
        """The last proposal's context copy (whether or not it became the chain draft), for
        a tree to hold as one branch; None when the lookup found none."""
        return None if self._copy is None else list(self._copy)

    def confidence(self) -> list[float] | None:
        """The probability of each guess of the last :meth:`propose` (module docstring)."""
        return None if self._confidence is None else list(self._confidence)

    def propose(
        self, context: list[int], last: int, block_size: int, features: Tensor | None
    ) -> list[int]:
        """``block_size - 1`` guesses after ``last``: the copy or the DFlash drafter's."""
        self._confidence = None
        # the DFlash drafter checks every argument (and raises before anything changes)
        guesses = self.dflash.propose(context, last, block_size, features)
        if features is not None and features.shape[0] == len(context):
            self._new_generation()  # every row given again: a new context
        draft = self._choose(context, last, guesses)
        confidence = self.dflash.confidence()
        if draft is not guesses:  # copied: each guess scored max(p_i, q)
            q = self.copy_acceptance
            confidence = [max(p, q) for p in self.dflash.probabilities(draft)]
        self._confidence = confidence
        return draft

    def revise(self, context: list[int], last: int, guesses: list[int]) -> list[int]:
        """The next step's draft from the guesses the DFlash drafter made on the device:
        the copy when it starts with their first guess, else those guesses
        (:class:`~dflash.model.drafters.base.RevisingDrafter`)."""
        check_block_size(len(guesses) + 1)
        check_token("last", last)  # the lookup checks the context
        self._confidence = None
        return self._choose(context, last, list(guesses))

    def _choose(self, context: list[int], last: int, guesses: list[int]) -> list[int]:
        """The rule of the module docstring, counted; ``guesses`` itself when not copied."""
        found = self.lookup.lookup(context, last, len(guesses) + 1)  # checks the context
        self._observe(context, last)
        self.drafts += 1
        copy = list(found.tokens)
        self._copy = copy if found.ngram else None
        if found.ngram == 0 or copy[0] != guesses[0]:
            return guesses
        self.copied_drafts += 1
        self._pending = _Copied(len(context), last, tuple(copy))
        return copy

    def _observe(self, context: list[int], last: int) -> None:
        """Count the previous copied draft's accepted and rejected guesses, read from how
        the context grew; a context that did not grow from it starts a new generation."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        accepted = len(context) - pending.at - 1  # the guesses committed since
        grew = 0 <= accepted <= len(pending.guesses) and context[pending.at] == pending.last
        if not grew or tuple(context[pending.at + 1 :]) != pending.guesses[:accepted]:
            self._new_generation()
            return
        self.accepted += accepted
        if accepted < len(pending.guesses) and last != pending.guesses[accepted]:
            self.rejected += 1

    # -- drafting on the device: the DFlash drafter's own --------------------------------

    @property
    def device_buffers_version(self) -> int:
        return self.dflash.device_buffers_version

    def start_device(
        self, features: Tensor, last: int, capacity: int, block_size: int, start: int = 0,
        skipped: int = 0,
    ) -> Tensor:
        self._new_generation()
        return self.dflash.start_device(features, last, capacity, block_size, start, skipped)

    def can_continue_device(self, committed: int, capacity: int, block_size: int) -> bool:
        return self.dflash.can_continue_device(committed, capacity, block_size)

    def set_device_inputs(self, rows: Tensor, commit_n: Tensor, tokens: Tensor) -> None:
        self.dflash.set_device_inputs(rows, commit_n, tokens)

    def device_step(self) -> Tensor:
        return self.dflash.device_step()

    def use_device_candidates(self, k: int) -> None:
        self.dflash.use_device_candidates(k)
