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

from collections.abc import Callable

import torch
from torch import Tensor

TILE_ROWS = 16  # rows per tile: the Triton linear kernel's row tile, so CPU and GPU agree


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
