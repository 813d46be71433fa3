"""Position tiles: how invariant CPU forwards make a token's row independent of ``T``.

A decode (``T = 1``), a verify (``T = B``) and a replay (``T = n``) must compute the row of
the token at absolute position ``p`` with the same bits. On CPU torch, a row's bits can
depend on the shape of the call it is in (BLAS picks kernels and blockings by shape;
vector loops finish their tail with scalar code that rounds differently), but not on what
the *other* rows hold: matrix products and pointwise or per-row maths never mix rows, and
a fixed shape on a fixed thread count is computed the same way every time.

So every invariant CPU evaluation runs on **fixed-shape tiles** of :data:`TILE_ROWS`
rows, and the token at position ``p`` always sits in row ``p mod TILE_ROWS`` of its tile
(positions ``p - p mod TILE_ROWS …`` share one tile; the other rows are zero). The token
then meets exactly the same call — same shape, same row, same strides — whether it is
decoded alone or verified among fifteen others, and its result is the same bits. A
``T``-token call costs one evaluation per tile it touches (one or two for a 16-token
verify) instead of one per token.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import TypeGuard

import torch
from torch import Tensor

TILE_ROWS = 16  # rows per tile: the Triton linear kernel's row tile, so CPU and GPU agree
#: the fewest tokens a tile-aligned verify window holds (a shorter room takes the whole block)
MIN_WINDOW = 4
#: tokens a CPU verify window reaches past the previous step's commit (see tile_window)
WINDOW_MARGIN = 4
#: The cost model of a CPU step that the confidence window optimises, in plain decodes of
#: the same target (measured on the default pair, a 2-core CPU, ``benchmarks/cpu_step.py``
#: and ``benchmarks/cpu_window.py``): the step's fixed part — a one-token verify (1.03
#: decodes), the drafter's proposal and the bookkeeping —
STEP_COST = 1.40
#: each further verified token — its recurrent update and its attention row (0.036 measured
#: by ``benchmarks/cpu_window.py`` after the references' per-token loops were trimmed; 0.055
#: before) —
TOKEN_COST = 0.036
#: and a second position tile, whose every product and per-row operation runs again.
TILE_COST = 0.57
#: tokens committed per decode of cost before a generation has measured its own (the
#: engine then uses its running rate, see :func:`tile_window`)
DEFAULT_RATE = 1.5


def verify_cost(start: int, window: int) -> float:
    """The modelled cost, in plain decodes, of a CPU step verifying ``window`` tokens at
    position ``start``: :data:`STEP_COST`, :data:`TOKEN_COST` per token after the first,
    :data:`TILE_COST` per position tile after the first."""
    if start < 0 or window < 1:
        raise ValueError(f"'start' must be >= 0 and 'window' >= 1 (got {start}, {window})")
    tiles = -(-(start % TILE_ROWS + window) // TILE_ROWS)
    return STEP_COST + TOKEN_COST * (window - 1) + TILE_COST * (tiles - 1)


def is_confidence(probs: object, block: int) -> TypeGuard[list[float]]:
    """``probs`` is a list of ``block - 1`` floats in [0, 1] (a drafter's confidence)."""
    return (
        isinstance(probs, list)
        and len(probs) == block - 1
        and all(isinstance(c, float) and 0.0 <= c <= 1.0 for c in probs)
    )


def tile_window(
    start: int,
    block: int,
    last: tuple[int, int] | None = None,
    confidence: Sequence[float] | None = None,
    rate: float = DEFAULT_RATE,
) -> int:
    """The verify window for a ``block``-token draft whose first token sits at ``start``.

    A forward costs one evaluation per tile it touches, so (without ``confidence``) a
    verify that would spill a few rows into a second tile stops at the tile boundary:
    ``TILE_ROWS - start mod TILE_ROWS`` tokens when that is at least :data:`MIN_WINDOW`
    and less than ``block``, else the whole block.

    On CPU each verified token also costs its own recurrent update and attention row, so
    the window is cut further where the rest of the draft is unlikely to be accepted.
    Verifying a prefix of the draft is lossless (the rest was never going to be accepted
    without it); only the expected number of accepted tokens changes.

    ``confidence`` (the drafter's probability of each of its ``block - 1`` guesses, when
    it reports them): the window is the ``T`` in ``1 … block`` that maximises

        E[commit | T] - rate * verify_cost(start, T),   E[commit | T] = 1 + sum_{k<T} p_1 … p_k

    — the drafter's own expectation of the tokens the step commits, less what its modelled
    cost (:func:`verify_cost`) is worth at ``rate`` tokens per decode of cost. With
    ``rate`` the generation's long-run rate this is the step choice that maximises that
    rate (tokens per unit of cost over many steps): a guess within the tile is held while
    the chance that it and every guess before it are accepted is at least ``rate *
    TOKEN_COST`` (about 0.08), and the draft spills into the next tile only when the
    guesses there are worth :data:`TILE_COST` more. The tile's room is not a bound here;
    the cost model prices it.

    ``last`` (without ``confidence``) is ``(commit_n, window)`` of the previous step:
    accepted lengths come in runs, so after a step that did not accept its whole window
    the window is capped at ``commit_n +`` :data:`WINDOW_MARGIN` tokens (never below
    :data:`MIN_WINDOW`); after one that did, it is not capped.
    """
    if start < 0 or block < 1:
        raise ValueError(f"'start' must be >= 0 and 'block' >= 1 (got {start}, {block})")
    if confidence is not None:
        probs = list(confidence)
        if not is_confidence(probs, block):
            raise ValueError(
                f"'confidence' must be {block - 1} probabilities in [0, 1], one per guess "
                f"(got {probs!r})"
            )
        if isinstance(rate, bool) or not (
            isinstance(rate, (int, float)) and math.isfinite(rate) and rate > 0
        ):
            raise ValueError(f"'rate' must be a finite number > 0 (got {rate!r})")
        best, best_value = 1, 1.0 - rate * verify_cost(start, 1)
        expected, joint = 1.0, 1.0
        for t, c in enumerate(probs, start=2):
            joint *= c
            expected += joint
            value = expected - rate * verify_cost(start, t)
            if value > best_value:
                best, best_value = t, value
        return best
    room = TILE_ROWS - start % TILE_ROWS
    window = room if MIN_WINDOW <= room < block else block
    if last is not None:
        commit_n, verified = last
        if not 1 <= commit_n <= verified:
            raise ValueError(
                f"'last' must be (commit_n, window) with 1 <= commit_n <= window "
                f"(got {last!r})"
            )
        if commit_n < verified:
            window = min(window, max(MIN_WINDOW, commit_n + WINDOW_MARGIN))
    return window


class PositionTiles:
    """The tile layout of a ``[B, T, ...]`` forward whose row 0 sits at position ``start``."""

    __slots__ = ("start",)

    def __init__(self, start: int) -> None:
        if start < 0:
            raise ValueError(f"'start' must be a position >= 0 (got {start})")
        self.start = start

    def apply(self, fn: Callable[..., Tensor], *xs: Tensor) -> Tensor:
        """``fn(*xs)`` for ``xs: [B, T, ...]``, evaluated tile by tile.

        ``fn`` must compute each ``[b, t]`` row of its result from the ``[b, t]`` rows of
        its inputs only (matrix products, pointwise maths, reductions over trailing
        dimensions). It sees contiguous ``[B, TILE_ROWS, ...]`` tiles, zero outside the
        call's rows, and returns ``[B, TILE_ROWS, ...]``.
        """
        return self.apply_many(lambda *tile: (fn(*tile),), *xs)[0]

    def apply_many(
        self, fn: Callable[..., tuple[Tensor, ...]], *xs: Tensor
    ) -> tuple[Tensor, ...]:
        """:meth:`apply` for an ``fn`` that returns several ``[B, TILE_ROWS, ...]`` results."""
        b, t = xs[0].shape[:2]
        if t == 0:
            return fn(*xs)
        offset = self.start % TILE_ROWS
        tiles = -(-(offset + t) // TILE_ROWS)
        padded = []
        for x in xs:
            if x.shape[:2] != (b, t):
                raise ValueError(
                    f"tile inputs must share [B, T] = {[b, t]} (got shape {tuple(x.shape)})"
                )
            buf = x.new_zeros(b, tiles * TILE_ROWS, *x.shape[2:])
            buf[:, offset : offset + t] = x
            padded.append(buf)
        outs: list[tuple[Tensor, ...]] = []
        for i in range(tiles):
            rows = slice(i * TILE_ROWS, (i + 1) * TILE_ROWS)
            out = fn(*(p[:, rows].contiguous() for p in padded))
            if any(o.shape[:2] != (b, TILE_ROWS) for o in out):
                shapes = [tuple(o.shape) for o in out]
                raise ValueError(
                    f"a tile function must return [B, {TILE_ROWS}, ...] results (got {shapes})"
                )
            outs.append(out)
        wholes = outs[0] if tiles == 1 else tuple(
            torch.cat(parts, dim=1) for parts in zip(*outs, strict=True)
        )
        return tuple(w[:, offset : offset + t] for w in wholes)
