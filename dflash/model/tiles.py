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

A tree verify places its rows at positions ``start + depth(row)``: siblings share a
position, so rows that would meet in one tile row are spread over extra evaluations of
that tile (``offsets``); each row still sits alone in row ``p mod TILE_ROWS`` of a tile
that holds only rows of other positions, the call a plain decode of that row makes.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

TILE_ROWS = 16  # rows per tile: the Triton linear kernel's row tile, so CPU and GPU agree


class PositionTiles:
    """The tile layout of a ``[B, T, ...]`` forward whose row ``t`` sits at position
    ``start + t`` (a chain), or ``start + offsets[t]`` (a tree: ``offsets`` its depths)."""

    __slots__ = ("offsets", "start")

    def __init__(self, start: int, offsets: tuple[int, ...] | None = None) -> None:
        if start < 0:
            raise ValueError(f"'start' must be a position >= 0 (got {start})")
        if offsets is not None and any(o < 0 for o in offsets):
            raise ValueError(f"'offsets' must be >= 0 (got {list(offsets)})")
        self.start = start
        self.offsets = offsets

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
        if self.offsets is not None:
            return self._apply_at_offsets(fn, *xs)
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

    def _apply_at_offsets(
        self, fn: Callable[..., tuple[Tensor, ...]], *xs: Tensor
    ) -> tuple[Tensor, ...]:
        """:meth:`apply_many` with row ``t`` at position ``start + offsets[t]``: one
        evaluation per (tile, copy), the ``k``-th row of a position in copy ``k``."""
        assert self.offsets is not None
        b, t = xs[0].shape[:2]
        if len(self.offsets) != t:
            raise ValueError(f"'offsets' has {len(self.offsets)} entries for T={t} rows")
        for x in xs:
            if x.shape[:2] != (b, t):
                raise ValueError(
                    f"tile inputs must share [B, T] = {[b, t]} (got shape {tuple(x.shape)})"
                )
        groups: dict[tuple[int, int], list[tuple[int, int]]] = {}
        seen: dict[int, int] = {}
        for row, off in enumerate(self.offsets):
            pos = self.start + off
            copy = seen.get(pos, 0)
            seen[pos] = copy + 1
            groups.setdefault((pos // TILE_ROWS, copy), []).append((row, pos % TILE_ROWS))
        results: list[Tensor] = []
        for members in groups.values():
            rows = [r for r, _ in members]
            places = [p for _, p in members]
            tiles = []
            for x in xs:
                buf = x.new_zeros(b, TILE_ROWS, *x.shape[2:])
                buf[:, places] = x[:, rows]
                tiles.append(buf)
            out = fn(*tiles)
            if any(o.shape[:2] != (b, TILE_ROWS) for o in out):
                shapes = [tuple(o.shape) for o in out]
                raise ValueError(
                    f"a tile function must return [B, {TILE_ROWS}, ...] results (got {shapes})"
                )
            if not results:
                results = [o.new_empty(b, t, *o.shape[2:]) for o in out]
            for whole, o in zip(results, out, strict=True):
                whole[:, rows] = o[:, places]
        return tuple(results)
