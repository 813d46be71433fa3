"""Prompt-lookup (n-gram) drafter: continue the most recent earlier occurrence of the suffix.

With ``seq = context + [last]``, try ``n = max_ngram, ..., min_ngram``: the first ``n`` whose
suffix ``seq[-n:]`` occurred earlier wins, and the most recent earlier occurrence is used.
The proposal copies the tokens that followed it. When the copy reaches the end of ``seq``
it keeps reading from the proposal itself, i.e. the matched pattern repeats periodically,
so a match always yields ``block_size - 1`` tokens. With no match at any ``n`` the proposal
is ``last`` repeated. Everything is deterministic; no model is involved.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from dflash.model.drafters.base import check_block_size, check_context, check_token
from dflash.model.drafters.errors import DraftArgumentError


@dataclass(frozen=True, slots=True)
class LookupResult:
    """One lookup: the proposal and where it came from.

    ``ngram`` is the matched suffix length (0: no match, ``tokens`` is ``last`` repeated);
    ``match_start`` the index in ``context + [last]`` of the earlier occurrence; ``copied``
    how many proposed tokens were read from ``context + [last]`` before the periodic repeat.
    """

    tokens: tuple[int, ...]
    ngram: int
    match_start: int | None
    copied: int


class PromptLookupDrafter:
    """n-gram lookup over the context (see module docstring). Needs no target features."""

    label = "prompt-lookup"
    tap_layers: tuple[int, ...] = ()

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, max_search: int | None = None):
        """``max_search``: look only at the last ``max_search`` tokens (``None``: all)."""
        for name, value in (("max_ngram", max_ngram), ("min_ngram", min_ngram)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise DraftArgumentError(f"{name!r} must be an int >= 1 (got {value!r})")
        if min_ngram > max_ngram:
            raise DraftArgumentError(
                f"'min_ngram' ({min_ngram}) must be <= 'max_ngram' ({max_ngram})"
            )
        if max_search is not None and (
            isinstance(max_search, bool) or not isinstance(max_search, int) or max_search < 2
        ):
            raise DraftArgumentError(
                f"'max_search' must be None or an int >= 2 (got {max_search!r})"
            )
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self.max_search = max_search
        # the context of the previous call, every entry validated: a context that extends
        # it (the engine's, step after step) needs only its new entries checked
        self._checked: list[int] = []

    def _check_context(self, context: object) -> list[int]:
        """``check_context(context)``, re-checking only what the previous call did not."""
        if not isinstance(context, (list, tuple)):
            return check_context(context)  # raises, naming the type
        known = self._checked
        k = len(known)
        prefix = list(context[:k])
        # equal values are not enough: True == 1 and 1.0 == 1, so the types must be int too
        if not (k and len(context) >= k and prefix == known and set(map(type, prefix)) == {int}):
            k = 0
        for i in range(k, len(context)):
            check_token(f"context[{i}]", context[i])
        self._checked = list(context)
        return self._checked

    def lookup(self, context: list[int], last: int, block_size: int) -> LookupResult:
        """The proposal for ``context + [last]`` with its provenance."""
        check_block_size(block_size)
        check_token("last", last)
        seq = [*self._check_context(context), last]
        if self.max_search is not None:
            seq = seq[-self.max_search :]
        length = len(seq)
        match = _longest_recent_match(seq, self.max_ngram)
        if match is not None and match[0] >= self.min_ngram:
            n, start = match
            ext = list(seq)
            for k in range(block_size - 1):
                ext.append(ext[start + n + k])  # start+n+k < len(ext): periodic once past seq
            copied = min(block_size - 1, length - (start + n))
            offset = len(context) + 1 - length  # index shift when max_search trimmed seq
            return LookupResult(tuple(ext[length:]), n, start + offset, copied)
        return LookupResult((last,) * (block_size - 1), 0, None, 0)

    def propose(
        self, context: list[int], last: int, block_size: int, features: Tensor | None = None
    ) -> list[int]:
        """``block_size - 1`` tokens; ``features`` is ignored (this drafter reads no target)."""
        return list(self.lookup(context, last, block_size).tokens)


def _longest_recent_match(seq: list[int], max_ngram: int) -> tuple[int, int] | None:
    """``(n, j)``: the largest ``n <= max_ngram`` such that ``seq[j:j+n] == seq[-n:]`` for some
    ``j < len(seq) - n``, with the largest such ``j``; None when ``seq[-1]`` never occurred
    before. Every occurrence ends on a copy of ``seq[-1]``, so only those are examined,
    most recent first."""
    length = len(seq)
    last = seq[-1]
    backwards = seq[-2::-1]  # seq[:-1] reversed: r-th entry is seq[length - 2 - r]
    best: tuple[int, int] | None = None
    r = -1
    while True:  # the earlier occurrences of seq[-1], most recent first (searched in C)
        try:
            r = backwards.index(last, r + 1)
        except ValueError:
            return best
        i = length - 2 - r
        # n = common suffix length of seq[:i+1] and seq, capped by max_ngram and by i+1
        n = 1
        while n < max_ngram and n <= i and seq[i - n] == seq[length - 1 - n]:
            n += 1
        if best is None or n > best[0]:
            best = (n, i - n + 1)
            if n == max_ngram:
                return best
