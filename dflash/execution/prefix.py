"""A bounded cache of prefilled prefixes: a prompt that extends a cached one prefills only
the rest, and decodes exactly as it would have without the cache.

Why only at chunk boundaries: a prefill is not M-invariant, so the state after a token
depends on how the prefill was cut into forwards. Prefill chunks end at absolute
multiples of the target's ``prefill_chunk`` (:func:`dflash.execution.shards.chunk_bounds`),
so the state at such a boundary is the same bits whether one prefill of a long prompt
passed it or a prefill continued from it. An entry is therefore taken at the largest
boundary at or before a prompt's end, and a hit restores the longest cached boundary that
is a proper prefix of the new prompt and prefills the rest in the same chunks: the
logits, and so every token greedy or seeded sampling draws, equal a cold prefill's bit for
bit. (The decoded tokens of an earlier turn are not a cached prefix: they went through
decode and verify forwards, which round differently from a prefill of them.)

An entry holds copies (:class:`dflash.model.caches.CacheSnapshot` per shard: the KV rows,
the recurrent state and conv window) and the drafter's tap rows of the prefix (all of
them, or its reach), so it stays valid whatever the live caches do next. Entries are kept
in least-recently-used order within ``max_bytes``; an entry alone larger than that is not
kept.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from dflash.execution.drafts import tap_features
from dflash.execution.shards import ShardedTarget
from dflash.model.caches import CacheSnapshot


@dataclass(frozen=True)
class PrefixEntry:
    """The context of the first ``length`` tokens of ``tokens``: every shard's snapshot
    and the drafter's tap rows ``[R, F]`` of positions ``length - R … length - 1`` (None:
    a drafter without taps)."""

    tokens: tuple[int, ...]
    snapshots: tuple[CacheSnapshot, ...]
    features: Tensor | None

    @property
    def length(self) -> int:
        return len(self.tokens)

    @property
    def nbytes(self) -> int:
        feats = 0 if self.features is None else self.features.numel() * (
            self.features.element_size()
        )
        return sum(s.nbytes for s in self.snapshots) + feats


class PrefixCache:
    """Prefilled prefixes of one target, at its ``prefill_chunk`` boundaries, within
    ``max_bytes`` (see the module docstring)."""

    def __init__(self, max_bytes: int, chunk: int) -> None:
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0:
            raise ValueError(f"'max_bytes' must be an int >= 0 (got {max_bytes!r})")
        if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
            raise ValueError(
                f"a prefix cache needs the target's prefill chunk, an int >= 1 (got {chunk!r})"
            )
        self.max_bytes, self.chunk = max_bytes, chunk
        self._entries: OrderedDict[tuple[int, ...], PrefixEntry] = OrderedDict()
        self.hits = 0
        self.misses = 0

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self._entries.values())

    def __len__(self) -> int:
        return len(self._entries)

    def boundary(self, n: int) -> int:
        """The largest chunk boundary at or before position ``n``."""
        return n // self.chunk * self.chunk

    def lookup(self, prompt: Sequence[int]) -> PrefixEntry | None:
        """The longest cached prefix of ``prompt`` that leaves at least one token to
        prefill (its entry becomes the most recently used), or None."""
        tokens = tuple(prompt)
        for end in range(self.boundary(len(tokens) - 1), 0, -self.chunk):
            entry = self._entries.get(tokens[:end])
            if entry is not None:
                self._entries.move_to_end(entry.tokens)
                self.hits += 1
                return entry
        self.misses += 1
        return None

    def wants(self, prefix: Sequence[int]) -> bool:
        """Whether an entry for ``prefix`` (a boundary's tokens) would be new."""
        return len(prefix) > 0 and tuple(prefix) not in self._entries

    def put(self, entry: PrefixEntry) -> None:
        """Keep ``entry`` (the most recently used), dropping the least recently used ones
        until the cache fits ``max_bytes``; an entry larger than that is not kept."""
        if entry.length % self.chunk:
            raise ValueError(
                f"a prefix entry must end at a chunk boundary (a multiple of {self.chunk}; "
                f"got {entry.length} tokens)"
            )
        size = entry.nbytes
        if size > self.max_bytes:
            return
        self._entries[entry.tokens] = entry
        self._entries.move_to_end(entry.tokens)
        total = self.nbytes
        while total > self.max_bytes:
            _, dropped = self._entries.popitem(last=False)
            total -= dropped.nbytes

    def clear(self) -> None:
        self._entries.clear()


def prefill_through(
    target: ShardedTarget,
    prompt: Sequence[int],
    *,
    keep: int = 0,
    hit: PrefixEntry | None = None,
    cache: PrefixCache | None = None,
    taps: Sequence[int] = (),
    reach: int | None = None,
    on_chunk: Callable[[int, int], None] | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Prefill ``prompt[keep:]`` at ``keep`` on ``target`` (whose caches hold ``keep``
    positions: a restored ``hit``, a continued context, or none), caching the prompt's last
    chunk boundary in ``cache`` on the way → (the last row's logits, the ``taps`` layers'
    rows ``[R, F]`` of the prompt's last positions: all of them, the restored prefix's
    included, or the last ``reach``; None without taps). A drafter that reads only its
    last ``reach`` positions gets only those rows: the prefill keeps no more of them (a
    long prompt's would be O(prompt))."""
    end = len(prompt)
    cut = 0 if cache is None else cache.boundary(end)
    caching = cache is not None and keep < cut and cache.wants(prompt[:cut])
    spans = [(keep, cut), (cut, end)] if caching and cut < end else [(keep, end)]
    pieces: list[Tensor] = []
    if hit is not None and hit.features is not None:
        pieces.append(hit.features)
    logits: Tensor | None = None
    for lo, hi in spans:
        progress = None if on_chunk is None else _offset(on_chunk, lo - keep, end - keep)
        rows = hi - lo if reach is None else min(reach, hi - lo)
        logits, tapped = target.prefill(list(prompt[lo:hi]), lo, taps=taps, on_chunk=progress,
                                        tap_rows=rows)
        got = tap_features(target, taps, tapped, rows)
        if got is not None:
            pieces = [_last_rows(torch.cat([*pieces, got]), reach)]
        if caching and hi == cut:
            assert cache is not None  # caching says so
            cache.put(PrefixEntry(tuple(prompt[:cut]), tuple(target.snapshot()),
                                  pieces[0].clone() if pieces else None))
    assert logits is not None  # a prompt prefills at least one token
    return logits, (pieces[0] if pieces else None)


def _offset(
    on_chunk: Callable[[int, int], None], before: int, total: int
) -> Callable[[int, int], None]:
    """``on_chunk`` for one part of a prefill that began ``before`` tokens into it."""
    return lambda done, _n: on_chunk(before + done, total)


def _last_rows(rows: Tensor, n: int | None) -> Tensor:
    """The last ``n`` rows of ``rows`` ``[R, F]`` (all of them for None)."""
    return rows if n is None else rows[max(0, rows.shape[0] - n):]


__all__ = ["PrefixCache", "PrefixEntry", "prefill_through"]
