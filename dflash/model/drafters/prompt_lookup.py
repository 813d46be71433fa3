"""Prompt-lookup (n-gram) drafter: continue the most recent earlier occurrence of the suffix.

With ``seq = context + [last]``, try ``n = max_ngram, ..., min_ngram``: the first ``n`` whose
suffix ``seq[-n:]`` occurred earlier wins, and the most recent earlier occurrence is used.
The proposal copies the tokens that followed it. When the copy reaches the end of ``seq``
it keeps reading from the proposal itself, i.e. the matched pattern repeats periodically,
so a match always yields ``block_size - 1`` tokens. With no match at any ``n`` the proposal
is ``last`` repeated. Everything is deterministic; no model is involved.
"""

from __future__ import annotations

import operator
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
        # the context of the previous call, every entry validated (the caller's own int
        # objects), and where each token occurs in it: a context that extends it (the
        # engine's, step after step) needs only its new entries checked and indexed, so a
        # step costs about the same at 128k tokens as at 1k
        self._known: list[int] = []
        self._where: dict[int, list[int]] = {}

    def _check_context(self, context: object) -> list[int]:
        """``check_context(context)``, checking and indexing only what the previous call
        did not: the validated context (the same list object from call to call)."""
        if not isinstance(context, (list, tuple)):
            return check_context(context)  # raises, naming the type
        known = self._known
        k = len(known)
        # the same objects (a fast identity walk in C), or equal values that are all ints
        # (True == 1 and 1.0 == 1: equal values are not enough)
        same = k > 0 and len(context) >= k and (
            all(map(operator.is_, context, known))
            or (list(context[:k]) == known and set(map(type, context[:k])) == {int}))
        if not same:
            known, k = [], 0
            self._known, self._where = known, {}
        where = self._where
        for i in range(k, len(context)):
            token = check_token(f"context[{i}]", context[i])
            known.append(token)
            where.setdefault(token, []).append(i)
        return known

    def lookup(self, context: list[int], last: int, block_size: int) -> LookupResult:
        """The proposal for ``context + [last]`` with its provenance."""
        check_block_size(block_size)
        check_token("last", last)
        known = self._check_context(context)
        length = len(known) + 1  # seq = context + [last]
        lowest = 0 if self.max_search is None else max(0, length - self.max_search)
        match = self._longest_recent_match(known, last, lowest)
        if match is not None and match[0] >= self.min_ngram:
            n, start = match
            tokens: list[int] = []
            for k in range(block_size - 1):
                j = start + n + k  # past seq, the proposal repeats itself periodically
                tokens.append(known[j] if j < length - 1 else
                              last if j == length - 1 else tokens[j - length])
            copied = min(block_size - 1, length - (start + n))
            return LookupResult(tuple(tokens), n, start, copied)
        return LookupResult((last,) * (block_size - 1), 0, None, 0)

    def propose(
        self, context: list[int], last: int, block_size: int, features: Tensor | None = None
    ) -> list[int]:
        """``block_size - 1`` tokens; ``features`` is ignored (this drafter reads no target)."""
        return list(self.lookup(context, last, block_size).tokens)

    def _longest_recent_match(
        self, known: list[int], last: int, lowest: int
    ) -> tuple[int, int] | None:
        """With ``seq = known + [last]`` read from index ``lowest`` on: ``(n, j)``, the
        largest ``n <= max_ngram`` such that ``seq[j:j+n] == seq[-n:]`` for some ``lowest
        <= j < len(seq) - n``, with the largest such ``j``; None when ``last`` never
        occurred there. Every occurrence ends on a copy of ``last``, so only those are
        examined (from the index), most recent first."""
        end = len(known)  # seq[-1 - n] is known[end - n] for n >= 1
        best: tuple[int, int] | None = None
        for i in reversed(self._where.get(last, ())):
            if i < lowest:
                break
            # n: the common suffix length of seq[:i+1] and seq, capped by max_ngram and by
            # the searched window
            n = 1
            while n < self.max_ngram and n <= i - lowest and known[i - n] == known[end - n]:
                n += 1
            if best is None or n > best[0]:
                best = (n, i - n + 1)
                if n == self.max_ngram:
                    return best
        return best
