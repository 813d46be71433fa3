"""The verify window: how many tokens of a draft a step verifies.

A verify of a prefix of the draft is lossless (the rest could only be accepted after it),
so the window changes the speed and the step statistics, never the tokens. Two windows,
chosen once when a :class:`~dflash.execution.engine.SpecDecoder` is built
(``verify_window=``, ``--verify-window``):

- ``full`` (:class:`FullWindow`): every draft whole — what a drafter's τ at a block size
  means, and the only window on CUDA, where a wider verify costs about what a decode costs;
- ``auto`` (:class:`CpuWindow` on a target whose shards are all on the CPU, else
  :class:`FullWindow`): on CPU every verified token costs its own recurrent update and
  attention row and a verify pays once per position tile it touches
  (:mod:`dflash.model.tiles`), so the window is cut where the cost model below says the
  rest of the draft does not pay.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal, Protocol, TypeGuard

from dflash.model.tiles import TILE_ROWS

WindowChoice = Literal["auto", "full"]
WINDOW_CHOICES: tuple[WindowChoice, ...] = ("auto", "full")

#: the fewest tokens a tile-aligned verify window holds (a shorter room takes the whole block)
MIN_WINDOW = 4
#: tokens a CPU verify window reaches past the previous step's commit (see tile_window)
WINDOW_MARGIN = 4
#: The cost model of a CPU step that the confidence window optimises, in plain decodes of
#: the same target (``benchmarks/cpu_window.py`` measures the constants; BENCHMARKS.md has
#: the numbers): the step's fixed part — a one-token verify, the drafter's proposal and the
#: bookkeeping —
STEP_COST = 1.40
#: each further verified token — its recurrent update and its attention row —
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


class VerifyWindow(Protocol):
    """A step's verify window: ``size`` before the verify, ``record`` after it."""

    def size(self, start: int, block: int, confidence: Sequence[float] | None) -> int:
        """Tokens of a ``block``-token draft at position ``start`` to verify (1 … block)."""
        ...

    def record(self, start: int, window: int, commit_n: int) -> None:
        """The step at ``start`` verified ``window`` tokens and committed ``commit_n``."""
        ...


class FullWindow:
    """Every draft verified whole."""

    def size(self, start: int, block: int, confidence: Sequence[float] | None) -> int:
        return block

    def record(self, start: int, window: int, commit_n: int) -> None:
        return None


class CpuWindow:
    """:func:`tile_window` at this generation's own rate: the tokens committed per decode
    of modelled cost (:func:`verify_cost`) so far, :data:`DEFAULT_RATE` weighted as two
    steps' worth of prior; without the drafter's ``confidence``, capped after a partly
    accepted step (``last``)."""

    def __init__(self) -> None:
        self.tokens, self.cost = 0.0, 0.0
        self.last: tuple[int, int] | None = None  # (commit_n, window) of the previous step

    @property
    def rate(self) -> float:
        prior = 2 * STEP_COST
        return (self.tokens + DEFAULT_RATE * prior) / (self.cost + prior)

    def size(self, start: int, block: int, confidence: Sequence[float] | None) -> int:
        return tile_window(start, block, self.last, confidence, self.rate)

    def record(self, start: int, window: int, commit_n: int) -> None:
        self.tokens += commit_n
        self.cost += verify_cost(start, window)
        self.last = (commit_n, window)


def parse_window(value: object) -> WindowChoice:
    """``value`` as a :data:`WindowChoice`; ``ValueError`` naming it otherwise."""
    if value not in WINDOW_CHOICES:
        raise ValueError(
            f"'verify_window' must be one of {', '.join(WINDOW_CHOICES)} (got {value!r})"
        )
    return value


def make_window(choice: WindowChoice, devices: Sequence[str]) -> VerifyWindow:
    """The window ``choice`` names for a target on ``devices``: ``auto`` is
    :class:`CpuWindow` when every device is the CPU, else :class:`FullWindow`."""
    if parse_window(choice) == "auto" and all(d == "cpu" for d in devices):
        return CpuWindow()
    return FullWindow()
