"""Triton kernel: skinny GEMM ``y = x @ w.T + b`` whose rows do not depend on M.

Decode and verify forwards multiply a handful of rows (M = 1 … 128) by large weights, so
the work is a stream over the weight, and each weight byte should leave HBM once per call.
The reduction order of every output element is fixed by ``(N, K)`` alone:

- rows travel in FIXED 16-row tiles (masked): a ``[BLOCK_N, BLOCK_K] x [BLOCK_K, 16]``
  product per tile and K step, the weight tile on the MMA's large side, the rows on its
  16-wide side. An output element depends on its own row of x and the weight only —
  never on the other rows of the tile, nor on M;
- one program owns one ``(row group, N tile, K split)``. With *wide row tiles* (the
  default where they are validated, below) a row group is one tile of ``BLOCK_M`` = 16,
  32, 64 or 128 rows (the next power of two of M, at least 16, at most 128): each K step
  multiplies the weight tile by all its rows in one MMA. Otherwise a row group is ``M_TILES``
  consecutive 16-row tiles (``M_TILES`` = the next power of two of ``cdiv(M, 16)``, at most
  :data:`MAX_M_TILES`, so up to 128 rows share one program; more rows add row groups
  along grid axis 0). Each K step loads the weight tile ONCE and multiplies it with every
  row tile of the group in turn — ``M_TILES`` separate 16-wide products by the same
  :func:`mma` call, each into the tile's own float32 accumulator ``[BLOCK_N, 16]`` (the
  accumulators are separate values, unrolled at compile time). A tile's accumulator sees
  exactly the products and K order it would see alone; tiles past M load zeros and are
  not stored;
- K is walked in ascending ``BLOCK_K`` blocks; ``BLOCK_N``, ``BLOCK_K`` and the split-K
  count come from :func:`linear_config` ``(N, K, dtype)``, never from M;
- with split-K, each split writes its float32 partial sums to a workspace and a second
  pass (:func:`linear_reduce_kernel`) adds the splits in ascending order (then the bias)
  and rounds once. With ``DFLASH_SPLIT_FIXUP=1`` the last split of each ``(row group, N
  tile)`` to finish does it inside the same launch instead (an arrival counter per tile,
  :func:`last_split_reduces`), in the same order, to the same bits. No value is ever added
  by an atomic.

**Wide row tiles are guarded.** A 64-row MMA is another instruction than a 16-row one; the
tensor cores reduce each output element from its own row and column the same way whatever
the instruction's width (measured bitwise on the H200 at every 9B projection shape, bf16,
fp16 and float32, on data spread over 2^-20 … 2^20: ``benchmarks/wide_mma.py``), but that is
the hardware's behaviour, not a documented guarantee. So wide tiles become effective on a
device only after :func:`wide_row_tiles` has run the kernel at every width on such data and
found each row bitwise equal to the 16-row tiles; otherwise (or with ``DFLASH_WIDE_ROWS=0``)
every call keeps 16-row tiles — fail closed, still M-invariant either way.

``M`` is a runtime argument that Triton never specialises (``do_not_specialize``).
``M_TILES`` is a compile-time constant, so 1, 2, 4 and 8 tiles per program are up to four
binaries; their per-tile code is the same (the same 16-wide MMA over the same K blocks,
the same epilogue), only repeated, so a row's bits do not depend on how many tiles share
its program nor on its tile's position there. The pipeline depth (``num_stages``) shrinks
for wide groups (:func:`linear_config`) to keep shared memory in budget; it changes when
loads are issued, not what is summed.

Under the Triton interpreter (CPU tests) the tile products are computed by :func:`mma`'s
emulation, whose per-element summation order does not depend on a row's position; the
GPU runs ``tl.dot`` (the MMA computes each output element from its own row and column).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from dflash.kernels.checks import INTERPRET

#: rows per tile: the smallest MMA width, fixed so a row's tile layout never depends on M
BLOCK_M = 16
#: most row tiles one program multiplies by each weight tile it loads (128 rows)
MAX_M_TILES = 8
#: most rows one program holds (one wide tile, or MAX_M_TILES tiles of 16)
MAX_ROWS = BLOCK_M * MAX_M_TILES
#: programs the split-K rule aims for: two per SM of a 132-SM H200. A constant (not read
#: from the device) so the split count is a function of the shape only.
TARGET_PROGRAMS = 264
#: fewest K blocks a split must walk: fewer leaves the software pipeline mostly idle
MIN_K_BLOCKS = 4
#: shared memory one program's pipeline may fill: two programs per 228 KB H200 SM
STAGE_BYTES = 112 * 1024
#: fewest pipeline stages (one load in flight while one block is multiplied)
MIN_STAGES = 2
#: output elements per program of the split-K reduction pass
BLOCK_REDUCE = 512
#: arrival counters per device for the in-kernel split-K reduction (one per row group and
#: N tile of a launch; a launch with more falls back to the reduction pass)
SPLIT_COUNTERS = 65536


@dataclass(frozen=True)
class LinearConfig:
    """One launch configuration: tile sizes, split-K count and Triton launch options."""

    block_n: int
    block_k: int
    split_k: int
    num_warps: int
    num_stages: int


@dataclass(frozen=True)
class LinearLaunch:
    """What :func:`launch_linear` launches for one call: the configuration, the rows of
    one MMA (``block_m``) and the row tiles per program, the K extent of a split, the
    split count actually launched (at most ``config.split_k``: no split is left empty) and
    the grid ``(row groups, N tiles, splits)``."""

    config: LinearConfig
    m_tiles: int
    k_per_split: int
    split: int
    grid: tuple[int, int, int]
    block_m: int = BLOCK_M


def row_tiles_for(M: int, wide: bool) -> tuple[int, int]:
    """``(rows per MMA, row tiles per program)`` for ``M`` rows: wide, one tile of the
    next power of two of ``M`` rows (16 … 128); else :func:`m_tiles_for` tiles of 16."""
    if not wide:
        return BLOCK_M, m_tiles_for(M)
    if M < 1:
        raise ValueError(f"'M' must be >= 1 row (got {M})")
    return min(MAX_ROWS, max(BLOCK_M, int(triton.next_power_of_2(M)))), 1


def m_tiles_for(M: int) -> int:
    """Row tiles per program for ``M`` rows: the next power of two of ``cdiv(M, 16)``,
    at most :data:`MAX_M_TILES` (1 for ``M <= 16``, 8 from 113 rows on)."""
    if M < 1:
        raise ValueError(f"'M' must be >= 1 row (got {M})")
    return min(MAX_M_TILES, int(triton.next_power_of_2(triton.cdiv(M, BLOCK_M))))


def linear_config(N: int, K: int, dtype: torch.dtype, m_tiles: int = 1) -> LinearConfig:
    """The configuration for an ``[N, K]`` weight and ``m_tiles`` row tiles per program.

    Tiles and the split-K count depend on ``N``, ``K`` and dtype only (they fix the
    reduction order); ``m_tiles`` sets the pipeline depth alone.

    - ``BLOCK_K = 128`` for 16-bit weights (256-byte rows per load, 16 KB tiles with
      ``BLOCK_N = 64``), 64 for float32 (the same bytes);
    - ``BLOCK_N = 64`` (the Hopper warp-group MMA height), smaller only for ``N < 64``;
    - split-K doubles while the doubled grid of one row group stays within
      :data:`TARGET_PROGRAMS` programs and each split keeps at least
      :data:`MIN_K_BLOCKS` K blocks. At the 9B shapes: split 2 for N = 8192 (256
      programs), 4 for N = 4096 with K = 4096 or 12288 (256), 8 for N = 1024 and
      N = 32 (the K-block floor), 1 for N = 12288 (192) and the LM head (3880);
    - 4 warps. Pipeline stages: 4 for 16-bit weights, 3 for float32, fewer when a stage
      (one weight tile plus ``m_tiles`` row tiles) would push the pipeline past
      :data:`STAGE_BYTES`, never fewer than :data:`MIN_STAGES`. 16-bit, ``BLOCK_N = 64``:
      a stage is 20, 24, 32, 48 KB for 1, 2, 4, 8 tiles, so 4, 4, 3, 2 stages (80, 96,
      96, 96 KB); the accumulators take 8 float32 registers per thread per tile. For
      sm_90 the 16-bit kernel compiles to warp-group MMAs (64 x 16 x 16) fed by
      asynchronous copies, and two programs fit on an SM.
    """
    if m_tiles < 1 or m_tiles > MAX_M_TILES or m_tiles & (m_tiles - 1):
        raise ValueError(
            f"'m_tiles' must be a power of two in 1 … {MAX_M_TILES} (got {m_tiles})"
        )
    block_k = 64 if dtype == torch.float32 else 128
    block_n = 64 if N >= 64 else max(16, triton.next_power_of_2(N))
    n_tiles = triton.cdiv(N, block_n)
    k_blocks = triton.cdiv(K, block_k)
    split = 1
    while n_tiles * 2 * split <= TARGET_PROGRAMS and k_blocks // (2 * split) >= MIN_K_BLOCKS:
        split *= 2
    stage = (block_n + m_tiles * BLOCK_M) * block_k * dtype.itemsize
    stages = max(MIN_STAGES, min(3 if dtype == torch.float32 else 4, STAGE_BYTES // stage))
    return LinearConfig(block_n, block_k, split, num_warps=4, num_stages=stages)


def linear_launch(
    M: int, N: int, K: int, dtype: torch.dtype, config: LinearConfig | None = None,
    *, wide: bool = False,
) -> LinearLaunch:
    """The launch of an ``M``-row call on an ``[N, K]`` weight (``wide``: wide row tiles,
    :func:`row_tiles_for`).

    ``config`` overrides :func:`linear_config` (benchmark sweeps only: another config is
    another reduction order); its ``num_stages`` is then used as given. The grid has
    ``cdiv(N, block_n) * split`` programs per row group and one row group up to 128 rows,
    so the weight is read once per call.
    """
    block_m, tiles = row_tiles_for(M, wide)
    cfg = config or linear_config(N, K, dtype, block_m * tiles // BLOCK_M)
    k_per_split = triton.cdiv(triton.cdiv(K, cfg.split_k), cfg.block_k) * cfg.block_k
    split = triton.cdiv(K, k_per_split)   # never an empty split
    groups = triton.cdiv(triton.cdiv(M, block_m), tiles)
    grid = (groups, triton.cdiv(N, cfg.block_n), split)
    return LinearLaunch(cfg, tiles, k_per_split, split, grid, block_m)


@triton.jit  # type: ignore[untyped-decorator]  # triton ships no types
def mma(a, b, acc, F32: tl.constexpr, EMULATE: tl.constexpr):  # type: ignore[no-untyped-def]  # Triton values are untyped
    """``acc + a @ b`` (``a [M, K]``, ``b [K, N]``) with float32 accumulation.

    ``F32``: float32 operands, full-precision products (no TF32). ``EMULATE`` (the
    interpreter only): a broadcast multiply and a sum over K, which numpy reduces in the
    same order for every output element; numpy's matmul, which the interpreter would use
    for ``tl.dot``, does not (a row's result there depends on its position in the tile),
    so it cannot show the row independence that the GPU's MMA has.
    """
    if EMULATE:
        r = acc + tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], 1)
    elif F32:
        r = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        r = tl.dot(a, b, acc)
    return r


@triton.jit  # type: ignore[untyped-decorator]  # triton ships no types
def row_tile_dot(  # type: ignore[no-untyped-def]  # Triton values are untyped
    b_acc, b_w, x, o_k, m_k, i_t, M, s_xm,
    BLOCK_M: tl.constexpr, F32_DOT: tl.constexpr, EMULATE: tl.constexpr,
):
    """``b_acc + b_w @ x[rows of tile i_t, o_k].T``: one row tile's K step (rows past M
    load zeros). ``b_acc [BLOCK_N, BLOCK_M]`` is the tile's output, transposed."""
    o_m = i_t * BLOCK_M + tl.arange(0, BLOCK_M)
    p_x = x + o_m[None, :] * s_xm + o_k[:, None]
    b_x = tl.load(p_x, mask=m_k[:, None] & (o_m < M)[None, :], other=0)   # [BLOCK_K, BLOCK_M]
    return mma(b_w, b_x, b_acc, F32_DOT, EMULATE)


@triton.jit  # type: ignore[untyped-decorator]  # triton ships no types
def row_tile_store(  # type: ignore[no-untyped-def]  # Triton values are untyped
    b_acc, i_t, o_n, m_n, b, y, ws, i_s, M, N, s_ym,
    SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
):
    """Row tile ``i_t``'s result: (+ bias, rounded) into y, or its float32 partial sums
    into split ``i_s`` of the workspace. Rows past M are not stored."""
    o_m = i_t * BLOCK_M + tl.arange(0, BLOCK_M)
    m_y = m_n[:, None] & (o_m < M)[None, :]
    if SPLIT_K == 1:
        if HAS_BIAS:
            b_acc += tl.load(b + o_n, mask=m_n, other=0).to(tl.float32)[:, None]
        p_y = y + o_m[None, :] * s_ym + o_n[:, None]
        tl.store(p_y, b_acc.to(y.dtype.element_ty), mask=m_y)
    else:
        p_ws = ws + (i_s * M + o_m[None, :]) * N + o_n[:, None]
        tl.store(p_ws, b_acc, mask=m_y)


@triton.jit  # type: ignore[untyped-decorator]  # triton ships no types
def last_split_reduces(  # type: ignore[no-untyped-def]  # Triton values are untyped
    ws, b, y, counters, t0, o_n, m_n, M, N, s_ym,
    SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
    M_TILES: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """The split-K reduction inside the kernel, run by the last split to finish.

    Called after the program stored its row tiles' float32 partial sums. The program
    synchronises (its threads' stores ordered before what follows, as a CTA barrier
    orders them), then one thread adds 1 to the ``(row group, N tile)``'s arrival counter
    with an acquire-release atomic at GPU scope (the release publishes the program's
    stores, the acquire makes the earlier splits' visible). The program that sees
    ``SPLIT_K - 1`` arrived last: every split's partials are visible to it, and it adds
    them exactly as :func:`linear_reduce_kernel` does — split 0, then 1 … ``SPLIT_K - 1``
    in ascending order, then the bias, rounded once — for each of its row tiles, then sets
    the counter back to 0 for the next launch. The order of the sum never depends on which
    split arrives last, so the bits are the reduction pass's; no value is added by an
    atomic. The counters are shared by every launch on the device: launches on one stream
    run one after another (two streams multiplying at once on one device would share them).
    """
    tl.debug_barrier()
    i_c = tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
    arrived = tl.atomic_add(counters + i_c, 1, sem="acq_rel", scope="gpu")
    if arrived == SPLIT_K - 1:
        for t in range(0, M_TILES):   # a loop, not unrolled (registers)
            o_m = (t0 + t) * BLOCK_M + tl.arange(0, BLOCK_M)
            m_y = m_n[:, None] & (o_m < M)[None, :]
            p_ws = ws + o_m[None, :] * N + o_n[:, None]
            # .cg: from L2, never a line this SM's L1 may hold from before. Ascending split
            # order, fixed: the splits are loaded four at a time (four loads in flight, four
            # tiles of registers), then added one after another. -0.0 is the identity of
            # float addition (x + -0.0 == x for every x, -0.0 and +0.0 included): the sum
            # starts there, and a load past the last split reads it
            b_acc = tl.full([BLOCK_N, BLOCK_M], -0.0, dtype=tl.float32)
            for i_s in range(0, SPLIT_K, 4):
                b_0 = tl.load(p_ws + i_s * M * N, mask=m_y, other=-0.0, cache_modifier=".cg")
                b_1 = tl.load(p_ws + (i_s + 1) * M * N, mask=m_y & (i_s + 1 < SPLIT_K),
                              other=-0.0, cache_modifier=".cg")
                b_2 = tl.load(p_ws + (i_s + 2) * M * N, mask=m_y & (i_s + 2 < SPLIT_K),
                              other=-0.0, cache_modifier=".cg")
                b_3 = tl.load(p_ws + (i_s + 3) * M * N, mask=m_y & (i_s + 3 < SPLIT_K),
                              other=-0.0, cache_modifier=".cg")
                b_acc = (((b_acc + b_0) + b_1) + b_2) + b_3
            if HAS_BIAS:
                b_acc += tl.load(b + o_n, mask=m_n, other=0).to(tl.float32)[:, None]
            p_y = y + o_m[None, :] * s_ym + o_n[:, None]
            tl.store(p_y, b_acc.to(y.dtype.element_ty), mask=m_y)
        tl.atomic_xchg(counters + i_c, 0, sem="relaxed", scope="gpu")


@triton.jit(do_not_specialize=["M"])  # type: ignore[untyped-decorator]  # triton ships no types
def linear_kernel(  # type: ignore[no-untyped-def]  # Triton pointers are untyped
    x, w, b, y, ws,          # x [M, K] (row stride s_xm), w [N, K] (s_wn), b [N], y [M, N] (s_ym)
    counters,                # int32 arrival counters (FIXUP), zero between launches
    M, N, K, s_xm, s_wn, s_ym,   # ws [SPLIT_K, M, N] float32 partials (SPLIT_K > 1)
    K_PER_SPLIT: tl.constexpr, SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_M: tl.constexpr,
    M_TILES: tl.constexpr, F32_DOT: tl.constexpr, EMULATE: tl.constexpr,
    FIXUP: tl.constexpr,
):
    i_g = tl.program_id(0).to(tl.int64)   # row group: tiles i_g * M_TILES + 0 … M_TILES - 1
    i_n = tl.program_id(1).to(tl.int64)
    i_s = tl.program_id(2).to(tl.int64)
    t0 = i_g * M_TILES
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_n = o_n < N
    k0 = i_s * K_PER_SPLIT

    # one accumulator per row tile (y tile, transposed); Triton has no lists of tensors,
    # so the tiles are unrolled by compile-time conditions on M_TILES (1, 2, 4 or 8)
    b_acc0 = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    if M_TILES > 1:
        b_acc1 = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    if M_TILES > 2:
        b_acc2 = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        b_acc3 = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    if M_TILES > 4:
        b_acc4 = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        b_acc5 = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        b_acc6 = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        b_acc7 = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for kk in range(0, K_PER_SPLIT, BLOCK_K):
        o_k = k0 + kk + tl.arange(0, BLOCK_K)
        m_k = o_k < K
        p_w = w + o_n[:, None] * s_wn + o_k[None, :]
        b_w = tl.load(p_w, mask=m_n[:, None] & m_k[None, :], other=0)   # [BLOCK_N, BLOCK_K]
        # the one weight tile times each row tile in turn: the same 16-wide product
        b_acc0 = row_tile_dot(b_acc0, b_w, x, o_k, m_k, t0, M, s_xm,
                              BLOCK_M, F32_DOT, EMULATE)
        if M_TILES > 1:
            b_acc1 = row_tile_dot(b_acc1, b_w, x, o_k, m_k, t0 + 1, M, s_xm,
                                  BLOCK_M, F32_DOT, EMULATE)
        if M_TILES > 2:
            b_acc2 = row_tile_dot(b_acc2, b_w, x, o_k, m_k, t0 + 2, M, s_xm,
                                  BLOCK_M, F32_DOT, EMULATE)
            b_acc3 = row_tile_dot(b_acc3, b_w, x, o_k, m_k, t0 + 3, M, s_xm,
                                  BLOCK_M, F32_DOT, EMULATE)
        if M_TILES > 4:
            b_acc4 = row_tile_dot(b_acc4, b_w, x, o_k, m_k, t0 + 4, M, s_xm,
                                  BLOCK_M, F32_DOT, EMULATE)
            b_acc5 = row_tile_dot(b_acc5, b_w, x, o_k, m_k, t0 + 5, M, s_xm,
                                  BLOCK_M, F32_DOT, EMULATE)
            b_acc6 = row_tile_dot(b_acc6, b_w, x, o_k, m_k, t0 + 6, M, s_xm,
                                  BLOCK_M, F32_DOT, EMULATE)
            b_acc7 = row_tile_dot(b_acc7, b_w, x, o_k, m_k, t0 + 7, M, s_xm,
                                  BLOCK_M, F32_DOT, EMULATE)

    row_tile_store(b_acc0, t0, o_n, m_n, b, y, ws, i_s, M, N, s_ym, SPLIT_K, HAS_BIAS, BLOCK_M)
    if M_TILES > 1:
        row_tile_store(b_acc1, t0 + 1, o_n, m_n, b, y, ws, i_s, M, N, s_ym,
                       SPLIT_K, HAS_BIAS, BLOCK_M)
    if M_TILES > 2:
        row_tile_store(b_acc2, t0 + 2, o_n, m_n, b, y, ws, i_s, M, N, s_ym,
                       SPLIT_K, HAS_BIAS, BLOCK_M)
        row_tile_store(b_acc3, t0 + 3, o_n, m_n, b, y, ws, i_s, M, N, s_ym,
                       SPLIT_K, HAS_BIAS, BLOCK_M)
    if M_TILES > 4:
        row_tile_store(b_acc4, t0 + 4, o_n, m_n, b, y, ws, i_s, M, N, s_ym,
                       SPLIT_K, HAS_BIAS, BLOCK_M)
        row_tile_store(b_acc5, t0 + 5, o_n, m_n, b, y, ws, i_s, M, N, s_ym,
                       SPLIT_K, HAS_BIAS, BLOCK_M)
        row_tile_store(b_acc6, t0 + 6, o_n, m_n, b, y, ws, i_s, M, N, s_ym,
                       SPLIT_K, HAS_BIAS, BLOCK_M)
        row_tile_store(b_acc7, t0 + 7, o_n, m_n, b, y, ws, i_s, M, N, s_ym,
                       SPLIT_K, HAS_BIAS, BLOCK_M)
    if SPLIT_K > 1 and FIXUP:
        last_split_reduces(ws, b, y, counters, t0, o_n, m_n, M, N, s_ym,
                           SPLIT_K, HAS_BIAS, BLOCK_M, M_TILES, BLOCK_N)


@triton.jit(do_not_specialize=["M"])  # type: ignore[untyped-decorator]  # triton ships no types
def linear_reduce_kernel(  # type: ignore[no-untyped-def]  # Triton pointers are untyped
    ws, b, y, M, N, s_ym,        # ws [SPLIT_K, M, N] float32 -> y [M, N] (row stride s_ym)
    SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr,
):
    i_n = tl.program_id(0).to(tl.int64)
    i_m = tl.program_id(1).to(tl.int64)
    o_n = i_n * BLOCK + tl.arange(0, BLOCK)
    m_n = o_n < N
    b_acc = tl.load(ws + i_m * N + o_n, mask=m_n, other=0)
    for s in tl.static_range(1, SPLIT_K):   # ascending split order, fixed
        b_acc += tl.load(ws + (s * M + i_m) * N + o_n, mask=m_n, other=0)
    if HAS_BIAS:
        b_acc += tl.load(b + o_n, mask=m_n, other=0).to(tl.float32)
    tl.store(y + i_m * s_ym + o_n, b_acc.to(y.dtype.element_ty), mask=m_n)


#: per device: the arrival counters of the in-kernel split-K reduction (all zero between
#: launches: the last split of each counter sets it back)
_COUNTERS: dict[torch.device, torch.Tensor] = {}
#: whether the split-K partial sums are reduced inside the kernel (``DFLASH_SPLIT_FIXUP=1``)
#: or by the separate reduction pass (the default): the same bits. Off by default: measured
#: on an H100 (``BENCHMARKS.md``, "FP8 projection groups fused") it took what the pass
#: takes, with its loads in series and four at a time alike
SPLIT_FIXUP = os.environ.get("DFLASH_SPLIT_FIXUP", "0") == "1"


def split_counters(device: torch.device, count: int) -> torch.Tensor | None:
    """The device's arrival counters for a split-K launch of ``count`` (row group, N tile)
    pairs (:func:`last_split_reduces`), or None: the reduction pass then adds the splits
    (the same bits). None when :data:`SPLIT_FIXUP` is off, when ``count`` exceeds
    :data:`SPLIT_COUNTERS`, and while a CUDA graph is being captured on a device whose
    counters were never allocated (they are allocated eagerly, zeroed once, and kept for
    the process: a captured graph holds their address)."""
    if not SPLIT_FIXUP or count > SPLIT_COUNTERS:
        return None
    counters = _COUNTERS.get(device)
    if counters is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        counters = torch.zeros(SPLIT_COUNTERS, dtype=torch.int32, device=device)
        _COUNTERS[device] = counters
    return counters


def launch_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
    out: torch.Tensor | None, config: LinearConfig | None = None,
    *, wide: bool | None = None,
) -> torch.Tensor:
    """Launch :func:`linear_kernel` (and the reduction pass) on validated inputs.

    ``config`` overrides :func:`linear_config` (benchmark sweeps only: another config is
    another reduction order). ``wide``: wide row tiles; None: :func:`wide_row_tiles` of
    x's device and dtype (validated once, then cached).
    """
    N, K = weight.shape
    lead = x.shape[:-1]
    x2 = x.reshape(-1, K)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    M = x2.shape[0]
    if out is None:
        out = torch.empty(*lead, N, dtype=x.dtype, device=x.device)
    y2 = out.view(-1, N)
    if M == 0:
        return out
    if wide is None:
        wide = M > BLOCK_M and wide_row_tiles(x.device, x.dtype)
    plan = linear_launch(M, N, K, x.dtype, config, wide=wide)
    cfg, split = plan.config, plan.split
    ws = (torch.empty(split, M, N, dtype=torch.float32, device=x.device) if split > 1
          else y2)
    b = weight if bias is None else bias
    counters = split_counters(x.device, plan.grid[0] * plan.grid[1]) if split > 1 else None
    linear_kernel[plan.grid](
        x2, weight, b, y2, ws, ws if counters is None else counters,
        M, N, K, x2.stride(0), weight.stride(0), y2.stride(0),
        K_PER_SPLIT=plan.k_per_split, SPLIT_K=split, HAS_BIAS=bias is not None,
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, BLOCK_M=plan.block_m, M_TILES=plan.m_tiles,
        F32_DOT=x.dtype == torch.float32, EMULATE=INTERPRET, FIXUP=counters is not None,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if split > 1 and counters is None:
        linear_reduce_kernel[(triton.cdiv(N, BLOCK_REDUCE), M)](
            ws, b, y2, M, N, y2.stride(0),
            SPLIT_K=split, HAS_BIAS=bias is not None, BLOCK=BLOCK_REDUCE, num_warps=4,
        )
    return out


# -- the guard of wide row tiles -----------------------------------------------------------

#: per (device, dtype): whether wide row tiles gave the 16-row tiles' bits (None: untested)
_WIDE_CHECKED: dict[tuple[torch.device, torch.dtype], bool] = {}
#: the shapes the self-test runs: a split-K shape with 64-wide weight tiles and a narrow
#: N (32-wide tiles, as the 9B model's gate projections); the interpreter takes a small one
_WIDE_SHAPES_GPU = ((192, 1024), (32, 512))
_WIDE_SHAPES_INTERPRETED = ((40, 96),)


def _hostile(rows: int, cols: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Values of random sign whose magnitudes span 2^-20 … 2^20 (2^-6 … 2^6 in fp16, so
    no sum overflows its output): their sums round differently in any other order."""
    lim = 6 if dtype == torch.float16 else 20
    mant = torch.rand(rows, cols, generator=gen) + 1.0
    exp = torch.randint(-lim, lim + 1, (rows, cols), generator=gen).to(torch.float32)
    sign = torch.randint(0, 2, (rows, cols), generator=gen).to(torch.float32) * 2 - 1
    return (sign * mant * torch.exp2(exp)).to(dtype)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bit patterns (so ``torch.equal`` compares bits: -0.0 differs from 0.0)."""
    return t.view(torch.int16 if t.dtype.itemsize == 2 else torch.int32)


def wide_rows_hold(device: torch.device, dtype: torch.dtype) -> bool:
    """Run the self-test of wide row tiles on ``device`` in ``dtype`` (uncached): at each
    self-test shape, 128 rows of hostile data through 32-, 64- and 128-row tiles must give
    every output bit of 16-row tiles (split-K, its reduction pass and a bias included)."""
    gen = torch.Generator().manual_seed(20261204)
    shapes = _WIDE_SHAPES_INTERPRETED if device.type == "cpu" else _WIDE_SHAPES_GPU
    for N, K in shapes:
        x = _hostile(MAX_ROWS, K, dtype, gen).to(device)
        w = _hostile(N, K, dtype, gen).to(device)
        b = _hostile(1, N, dtype, gen).view(N).to(device)
        narrow = launch_linear(x, w, b, None, wide=False)
        for M in (32, 64, MAX_ROWS):   # one tile of 32, 64 and 128 rows
            got = launch_linear(x[:M], w, b, None, wide=True)
            if not torch.equal(_bits(got), _bits(narrow[:M])):
                return False
    return True


def wide_row_tiles(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether calls on ``device`` in ``dtype`` use wide row tiles: ``DFLASH_WIDE_ROWS``
    is not ``0`` and :func:`wide_rows_hold` passed (run once per device and dtype, then
    cached; a failure keeps 16-row tiles for the process)."""
    if os.environ.get("DFLASH_WIDE_ROWS", "1") == "0":
        return False
    key = (device, dtype)
    got = _WIDE_CHECKED.get(key)
    if got is None:
        got = _WIDE_CHECKED[key] = wide_rows_hold(device, dtype)
    return got
