"""Triton kernel: causal decode/verify attention whose rows do not depend on T.

Pass 1, one program per (row group, key split, batch x KV head), the group varying
fastest: the ``G * T`` query rows of one KV head (``G = H // HKV`` query heads per KV
head, row ``r = t * G + g``) travel in FIXED 16-row tiles (masked). A program may hold
up to four consecutive tiles (``row_tiles``), each with its own softmax state, and load
each key block once for all of them (a 16-row verify of a 4-head GQA group, 64 rows, then
reads its K/V once, not once per tile; one tile per program is the default, see
:data:`MAX_ROW_TILES`). The key range
``0 .. S_max - 1`` is cut into splits at absolute key indices: :data:`SPLIT_KEYS` keys
each below :data:`WIDE_FROM`, :data:`WIDE_KEYS` keys each from there (constants: many
programs for a short context, few splits for the combine of a long one). Each split is
walked in ascending ``BLOCK_N`` blocks aligned to the absolute key index, up to the last
key a row of the tile can see, with an online softmax in float32. A program writes, per
row, the running max ``m``, the sum ``l`` and the unnormalised output of its split to a
float32 workspace. Pass 2, one program per query row, combines the splits the row can see
(those up to the one holding key ``start + t``, and only those: its cost follows the
context, not the cache's capacity) by log-sum-exp: the max over them, then the weighted
sums in tiles of :data:`COMBINE_SPLITS` splits cut at absolute multiples, each tile summed
by one fixed reduction and the tiles added in ascending order; the lanes of a tile past
the row's last split are exact zeros (masked loads), never workspace bytes.

The key loop: on the GPU a loop bounded at run time, which the compiler software-pipelines
(the next block's K and V copied to shared memory asynchronously while this one computes;
for sm_90 ``benchmarks/sm90_resources.py`` counts the program's ``LDGSTS``). The
interpreter cannot ``range()`` a run-time bound, so it walks the longest split's blocks as
a static loop that takes a block only below the bound: the same blocks, in the same
order, through the same block function (:func:`committed_block`).

Why a row's bits do not depend on T: the splits and blocks are fixed by absolute key
index; a block that holds no key visible to a row leaves that row's ``m``, ``l`` and
output exactly unchanged (its scores are ``-inf``: ``p = 0`` and the rescale factor is
forced to exactly 1), so the extra blocks a longer call walks for its later rows are
neutral for the earlier ones (and the blocks a program walks for its other tiles'
rows); a tile's arithmetic is the same whichever tiles share its program; and pass 2
reads exactly the same splits, in the same tiles, for the row.

``T`` and the strides that change with it are never specialised (``do_not_specialize``),
so every ``T`` runs the same binary. The grid depends on shapes only (``S_max``, ``T``,
heads): programs whose split starts past the tile's last visible key exit at once.
``start`` is read from device memory, so the launch can be captured in a CUDA graph.
Keys at or past ``start + t_last + 1`` (and past ``S_max``) are never loaded, so
unwritten cache rows may hold anything.

Tree verify (``TREE``, ``paths`` an int32 ``[T, T]`` table, ``B == 1``): row ``t`` is
draft node ``t`` at position ``start + depth(t)`` (its count of non-negative ``paths``
entries minus one, read on the device) and walks a LOGICAL key sequence: logical key ``j``
is cache row ``j`` for ``j < start`` and cache row ``start + paths[t, j - start]`` from
``start`` on, up to ``start + depth(t)``. Blocks and splits are cut by the logical index
exactly as a chain cuts the absolute one. A block wholly below ``start`` is the same for
every row and is loaded once for the program's tiles; a block that reaches ``start`` is
gathered once per node of the program (masked loads through the table), and each such pass
updates only that node's rows, in the tiles that hold them (the others see no key of it
and stay unchanged, as above). So each row
loads, in each block, exactly the keys and values a ``T = 1`` chain call at
``start + depth(t)`` loads from the cache plain decoding would hold (the path's keys at
contiguous rows), in the same columns, and its reduction (scores, online softmax, the
combine over the splits up to the one holding ``start + depth(t)``) is that call's, bit
for bit. Gathered rows outside ``0 .. S_max - 1`` are never loaded, whatever the table
holds. With ``TREE`` off the tree code is compiled out: a chain runs the arithmetic it
always ran.

Tile products go through :func:`dflash.kernels.linear_triton.mma` (``tl.dot`` on the GPU,
a row-order-independent emulation under the interpreter).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from dflash.kernels.checks import INTERPRET
from dflash.kernels.linear_triton import mma

#: query rows per tile (the smallest MMA width), fixed so the layout never depends on T
BLOCK_M = 16
#: keys per block of the inner loop
BLOCK_N = 64
#: keys per split below :data:`WIDE_FROM`: constants, so a row's split boundaries never
#: depend on T, the length or the cache's capacity
SPLIT_KEYS = 128
#: the key index from which splits are :data:`WIDE_KEYS` wide (a multiple of SPLIT_KEYS):
#: short contexts keep many programs, long ones few splits for the combine to walk
WIDE_FROM = 16384
#: keys per split from :data:`WIDE_FROM` on
WIDE_KEYS = 2048
#: splits the combine pass reads per step (a fixed tile, summed by one fixed reduction)
COMBINE_SPLITS = 16


def row_tiles_from_env(default: int) -> int:
    """``DFLASH_ATTENTION_ROW_TILES`` (1, 2 or 4) if set, else ``default``; another value
    is a ``ValueError`` naming it."""
    raw = os.environ.get("DFLASH_ATTENTION_ROW_TILES", "")
    if raw == "":
        return default
    if raw not in ("1", "2", "4"):
        raise ValueError(f"DFLASH_ATTENTION_ROW_TILES must be 1, 2 or 4 (got {raw!r})")
    return int(raw)


#: the most row tiles one program holds by default (each key block loaded once for all of
#: them; a 16-row verify of a 4-query-head GQA group is 64 rows, four tiles). 1 until the
#: wider programs pay: for sm_90 (triton 3.6, D = 256, the pipelined key loop) one tile
#: at 4 warps takes 195 registers and no stack, two tiles spill 136 bytes, four 712 (72
#: at 8 warps; ``benchmarks/sm90_resources.py``); on an H100 a 16-row verify at 131,072
#: keys took 381 µs with one tile per program, 399 with two and 431 with four at 8
#: warps (``benchmarks/hot_kernels.py --part tiles``).
#: ``DFLASH_ATTENTION_ROW_TILES`` (read once, at import) sets it for a process: any value
#: gives the same bits, so a benchmark can time a whole run with it
MAX_ROW_TILES = row_tiles_from_env(1)
#: warps per program by its row tiles (a row's bits do not depend on them: see
#: :func:`softmax_block`): on an H100 at 131,072 keys one tile was fastest at 4 warps (381
#: µs against 605 at 8), two at 4 (399 against 437), four at 8 (431 against 665)
WARPS_FOR_TILES = {1: 4, 2: 4, 4: 8}
#: the score of a masked key (a constexpr: Triton kernels read only constexpr globals)
NEG_INF = tl.constexpr(float("-inf"))
LOG2E = 1.4426950408889634


@triton.jit  # type: ignore[untyped-decorator]  # triton ships no types
def softmax_block(  # type: ignore[no-untyped-def]  # Triton values are untyped
    b_q, b_k, b_v, visible, b_m, b_l, b_o, qk_scale,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, F32_DOT: tl.constexpr,
    EMULATE: tl.constexpr,
):
    """One key block of the online softmax: keys/values ``b_k, b_v [BLOCK_N, BD]``,
    ``visible [BLOCK_M, BLOCK_N]``; returns the updated ``(b_m, b_l, b_o)``. A row that sees
    no key of the block keeps its state exactly (``p = 0``, rescale factor exactly 1).

    Every reduction whose order could depend on the program's warp count goes through the
    MMA, whose K order is fixed: the row sum of the (rounded) probabilities is their product
    with a block of ones, the same weights the output's product takes. The row max is
    exact in any order. So a row's bits do not depend on ``num_warps`` (a warp splits a
    tile's columns, and a cross-warp sum's order follows the warp count)."""
    b_s = mma(b_q, tl.trans(b_k), tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32),
              F32_DOT, EMULATE)
    b_s = tl.where(visible, b_s * qk_scale, NEG_INF)
    b_m_new = tl.maximum(b_m, tl.max(b_s, 1))
    # all-masked so far: subtract 0, not -inf (exp2(-inf - -inf) would be NaN)
    b_m_use = tl.where(b_m_new == NEG_INF, 0.0, b_m_new)
    # a block that does not raise the max rescales by exactly 1
    b_alpha = tl.where(b_m_new == b_m, 1.0, tl.math.exp2(b_m - b_m_use))
    b_p = tl.math.exp2(b_s - b_m_use[:, None]).to(b_v.dtype)
    ones = tl.full([BLOCK_N, 16], 1.0, tl.float32).to(b_v.dtype)
    # every column of the product is the row's sum, so their max is it, exactly
    b_sum = tl.max(mma(b_p, ones, tl.zeros([BLOCK_M, 16], dtype=tl.float32), F32_DOT,
                       EMULATE), 1)
    b_l = b_l * b_alpha + b_sum
    b_o = mma(b_p, b_v, b_o * b_alpha[:, None], F32_DOT, EMULATE)
    return b_m_new, b_l, b_o


@triton.jit  # type: ignore[untyped-decorator]  # triton ships no types
def node_depth(paths, s_pt, o_t, m_t, T, R: tl.constexpr, BLOCK_P: tl.constexpr):  # type: ignore[no-untyped-def]  # Triton values are untyped
    """Depth of the nodes ``o_t`` (an ``[R]`` tensor of slots; rows with ``m_t`` false read
    as depth -1): each node's count of non-negative ``paths`` entries minus one, read in
    chunks of ``BLOCK_P`` columns (``T`` is not specialised; rows ``s_pt`` apart)."""
    n_anc = tl.zeros([R], dtype=tl.int64)
    d0 = T * 0   # an int32 scalar, like the loop bound
    while d0 < T:   # a while loop: the interpreter cannot range() over a runtime bound
        o_p = d0 + tl.arange(0, BLOCK_P)
        b_e = tl.load(paths + o_t[:, None] * s_pt + o_p[None, :],
                      mask=m_t[:, None] & (o_p < T)[None, :], other=-1)
        n_anc += tl.sum((b_e >= 0).to(tl.int64), 1)
        d0 += BLOCK_P
    return n_anc - 1


@triton.jit  # type: ignore[untyped-decorator]  # triton ships no types
def split_of(pos, SPLIT: tl.constexpr, WIDE_FROM: tl.constexpr, WIDE: tl.constexpr):  # type: ignore[no-untyped-def]  # Triton values are untyped
    """The split holding key ``pos``: ``SPLIT``-key splits below ``WIDE_FROM``, then
    ``WIDE``-key ones, cut at absolute key indices."""
    return tl.where(pos < WIDE_FROM, pos // SPLIT,
                    WIDE_FROM // SPLIT + (pos - WIDE_FROM) // WIDE)


@triton.jit  # type: ignore[untyped-decorator]  # triton ships no types
def tile_rows(  # type: ignore[no-untyped-def]  # Triton values are untyped
    i_tile, i_hk, st, paths, s_pt, T, G, BLOCK_M: tl.constexpr, TREE: tl.constexpr,
):
    """Row tile ``i_tile`` of KV head ``i_hk``: its rows ``r = t * G + g`` as
    ``(m_r, o_t, o_h, pos)`` (valid, node, query head, absolute position), its first and
    last node and its last visible key (-1 for a tile of padding rows only)."""
    o_r = i_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    m_r = o_r < G * T
    o_t = o_r // G
    o_h = i_hk * G + o_r % G
    # the tile's first and last node, reduced from its rows (the scalar form
    # ``(i_tile * BLOCK_M) // G`` gave a wrong first tile on an H200 for G = 3, 5, 6)
    t_first = tl.min(tl.where(m_r, o_t, T), 0)
    t_last = tl.max(tl.where(m_r, o_t, -1), 0)
    if TREE:   # node t sits at start + depth(t) (paths [T, T], B == 1)
        pos = st + node_depth(paths, s_pt, o_t, m_r, T, BLOCK_M, BLOCK_M)
        p_last = tl.max(tl.where(m_r, pos, -1), 0)   # the tile's last visible key
    else:
        pos = st + o_t                               # absolute position of each row
        p_last = tl.where(t_last >= 0, st + t_last, -1)
    return m_r, o_t, o_h, pos, t_first, t_last, p_last


@triton.jit
def tile_query(  # type: ignore[no-untyped-def]  # Triton values are untyped
    q, i_b, o_t, o_h, m_r, o_d, m_d, s_qb, s_qt, s_qh,
):
    """The tile's query rows ``[BLOCK_M, BD]`` (padding rows and columns zero)."""
    p_q = q + i_b * s_qb + o_t[:, None] * s_qt + o_h[:, None] * s_qh + o_d[None, :]
    return tl.load(p_q, mask=m_r[:, None] & m_d[None, :], other=0)


@triton.jit  # type: ignore[untyped-decorator]  # triton ships no types
def tile_gathered_block(  # type: ignore[no-untyped-def]  # Triton values are untyped
    b_q, b_k, b_v, u, o_n, m_n, o_t, m_r, pos, t_first, t_last, b_m, b_l, b_o, qk_scale,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, F32_DOT: tl.constexpr,
    EMULATE: tl.constexpr,
):
    """A tree block gathered for node ``u``: the tile's rows of ``u`` updated, the tile
    left as it is when none of its rows is ``u`` (a tile without them would see no key
    of the pass and stay unchanged anyway: skipping it changes no bit)."""
    if (u >= t_first) & (u <= t_last):
        visible = ((o_t == u) & m_r)[:, None] & m_n[None, :]
        visible = visible & (o_n[None, :] <= pos[:, None])
        b_m, b_l, b_o = softmax_block(b_q, b_k, b_v, visible, b_m, b_l, b_o, qk_scale,
                                      BLOCK_M, BLOCK_N, F32_DOT, EMULATE)
    return b_m, b_l, b_o


@triton.jit  # type: ignore[untyped-decorator]  # triton ships no types
def committed_block(  # type: ignore[no-untyped-def]  # Triton values are untyped
    p_k0, p_v0, kb, k_hi, s_ks, s_vs, m_d, b_q0, b_q1, b_q2, b_q3, pos0, pos1, pos2, pos3,
    b_m0, b_l0, b_o0, b_m1, b_l1, b_o1, b_m2, b_l2, b_o2, b_m3, b_l3, b_o3, qk_scale,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, M_TILES: tl.constexpr,
    F32_DOT: tl.constexpr, EMULATE: tl.constexpr,
):
    """The key block from ``kb`` (keys below ``k_hi``, logical = physical): one K/V load
    for every row of the program's ``M_TILES`` tiles, each tile's state updated (the
    states of absent tiles are returned as they came)."""
    o_n = kb + tl.arange(0, BLOCK_N)
    m_kv = (o_n < k_hi)[:, None] & m_d[None, :]
    b_k = tl.load(p_k0 + o_n[:, None] * s_ks, mask=m_kv, other=0)   # [BLOCK_N, BD] each
    b_v = tl.load(p_v0 + o_n[:, None] * s_vs, mask=m_kv, other=0)
    b_m0, b_l0, b_o0 = softmax_block(b_q0, b_k, b_v, o_n[None, :] <= pos0[:, None], b_m0,
                                     b_l0, b_o0, qk_scale, BLOCK_M, BLOCK_N, F32_DOT, EMULATE)
    if M_TILES > 1:
        b_m1, b_l1, b_o1 = softmax_block(b_q1, b_k, b_v, o_n[None, :] <= pos1[:, None],
                                         b_m1, b_l1, b_o1, qk_scale, BLOCK_M, BLOCK_N,
                                         F32_DOT, EMULATE)
    if M_TILES > 2:
        b_m2, b_l2, b_o2 = softmax_block(b_q2, b_k, b_v, o_n[None, :] <= pos2[:, None],
                                         b_m2, b_l2, b_o2, qk_scale, BLOCK_M, BLOCK_N,
                                         F32_DOT, EMULATE)
        b_m3, b_l3, b_o3 = softmax_block(b_q3, b_k, b_v, o_n[None, :] <= pos3[:, None],
                                         b_m3, b_l3, b_o3, qk_scale, BLOCK_M, BLOCK_N,
                                         F32_DOT, EMULATE)
    return b_m0, b_l0, b_o0, b_m1, b_l1, b_o1, b_m2, b_l2, b_o2, b_m3, b_l3, b_o3


@triton.jit  # type: ignore[untyped-decorator]  # triton ships no types
def tile_store(  # type: ignore[no-untyped-def]  # Triton values are untyped
    b_m, b_l, b_o, i_b, i_s, o_t, o_h, m_r, o_d, m_d, ws_m, ws_l, ws_o, y,
    T, s_yb, s_yt, s_yh, H: tl.constexpr, D: tl.constexpr, NS: tl.constexpr,
    TREE: tl.constexpr,
):
    """The tile's split result: normalised into ``y`` (one split), else ``m``, ``l`` and
    the unnormalised output into the workspace."""
    if NS == 1:   # one split: normalise and write the output directly
        if TREE:   # the tile's padding rows saw no key (l = 0); they are not stored
            b_l = tl.where(m_r, b_l, 1.0)
        p_y = y + i_b * s_yb + o_t[:, None] * s_yt + o_h[:, None] * s_yh + o_d[None, :]
        b_y = b_o / b_l[:, None]
        tl.store(p_y, b_y.to(y.dtype.element_ty), mask=m_r[:, None] & m_d[None, :])
    else:
        row = (i_b * T + o_t) * H + o_h            # [BLOCK_M] row ids of the workspace
        tl.store(ws_m + row * NS + i_s, b_m, mask=m_r)
        tl.store(ws_l + row * NS + i_s, b_l, mask=m_r)
        p_o = ws_o + (row[:, None] * NS + i_s) * D + o_d[None, :]
        tl.store(p_o, b_o, mask=m_r[:, None] & m_d[None, :])


@triton.jit(do_not_specialize=["T", "s_qb", "s_yb", "s_pt"])  # type: ignore[untyped-decorator]  # triton ships no types
def attention_split_kernel(  # type: ignore[no-untyped-def]  # Triton pointers are untyped
    q, k, v, start, paths, ws_m, ws_l, ws_o, y,  # q [B,T,H,D]; k, v [B,HKV,S,D]; start [B]
    qk_scale,                                # softmax scale * log2(e)
    T, S_max, s_pt,                          # s_pt: the row stride of paths [T, T]
    s_qb, s_qt, s_qh, s_kb, s_kh, s_ks, s_vb, s_vh, s_vs, s_yb, s_yt, s_yh,
    H: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, NS: tl.constexpr,
    SPLIT: tl.constexpr, WIDE_FROM: tl.constexpr, WIDE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BD: tl.constexpr, TREE: tl.constexpr,
    M_TILES: tl.constexpr, SPLIT_BLOCKS: tl.constexpr, F32_DOT: tl.constexpr,
    EMULATE: tl.constexpr,
):
    G = H // HKV
    # a program holds M_TILES row tiles (one state each, unrolled) and loads each key
    # block once for all of them; the row groups vary fastest, so the groups of one split
    # run side by side
    i_g = tl.program_id(0).to(tl.int64)
    i_s = tl.program_id(1).to(tl.int64)
    i_bh = tl.program_id(2).to(tl.int64)
    i_b, i_hk = i_bh // HKV, i_bh % HKV
    st = tl.load(start + i_b).to(tl.int64)
    i_t0 = i_g * M_TILES

    m_r0, o_t0, o_h0, pos0, tf0, tl0, p_last = tile_rows(
        i_t0, i_hk, st, paths, s_pt, T, G, BLOCK_M, TREE)
    t_first = tf0
    t_last = tl0
    if M_TILES > 1:
        m_r1, o_t1, o_h1, pos1, tf1, tl1, pl1 = tile_rows(
            i_t0 + 1, i_hk, st, paths, s_pt, T, G, BLOCK_M, TREE)
        p_last = tl.maximum(p_last, pl1)
        t_last = tl.maximum(t_last, tl1)
    if M_TILES > 2:
        m_r2, o_t2, o_h2, pos2, tf2, tl2, pl2 = tile_rows(
            i_t0 + 2, i_hk, st, paths, s_pt, T, G, BLOCK_M, TREE)
        m_r3, o_t3, o_h3, pos3, tf3, tl3, pl3 = tile_rows(
            i_t0 + 3, i_hk, st, paths, s_pt, T, G, BLOCK_M, TREE)
        p_last = tl.maximum(p_last, tl.maximum(pl2, pl3))
        t_last = tl.maximum(t_last, tl.maximum(tl2, tl3))
    narrow = i_s < WIDE_FROM // SPLIT
    k_lo = tl.where(narrow, i_s * SPLIT, WIDE_FROM + (i_s - WIDE_FROM // SPLIT) * WIDE)
    k_end = k_lo + tl.where(narrow, SPLIT, WIDE)
    # the last key any row of the program's tiles sees: blocks past a tile's own last
    # key leave its rows unchanged (see above), so walking up to the program's is exact
    k_hi = tl.minimum(tl.minimum(k_end, p_last + 1), S_max)
    if k_lo < k_hi:   # else no row of this program sees a key of this split: nothing to do
        o_d = tl.arange(0, BD)
        m_d = o_d < D
        b_q0 = tile_query(q, i_b, o_t0, o_h0, m_r0, o_d, m_d, s_qb, s_qt, s_qh)
        b_m0 = tl.full([BLOCK_M], NEG_INF, dtype=tl.float32)
        b_l0 = tl.zeros([BLOCK_M], dtype=tl.float32)
        b_o0 = tl.zeros([BLOCK_M, BD], dtype=tl.float32)
        if M_TILES > 1:
            b_q1 = tile_query(q, i_b, o_t1, o_h1, m_r1, o_d, m_d, s_qb, s_qt, s_qh)
            b_m1 = tl.full([BLOCK_M], NEG_INF, dtype=tl.float32)
            b_l1 = tl.zeros([BLOCK_M], dtype=tl.float32)
            b_o1 = tl.zeros([BLOCK_M, BD], dtype=tl.float32)
        if M_TILES > 2:
            b_q2 = tile_query(q, i_b, o_t2, o_h2, m_r2, o_d, m_d, s_qb, s_qt, s_qh)
            b_m2 = tl.full([BLOCK_M], NEG_INF, dtype=tl.float32)
            b_l2 = tl.zeros([BLOCK_M], dtype=tl.float32)
            b_o2 = tl.zeros([BLOCK_M, BD], dtype=tl.float32)
            b_q3 = tile_query(q, i_b, o_t3, o_h3, m_r3, o_d, m_d, s_qb, s_qt, s_qh)
            b_m3 = tl.full([BLOCK_M], NEG_INF, dtype=tl.float32)
            b_l3 = tl.zeros([BLOCK_M], dtype=tl.float32)
            b_o3 = tl.zeros([BLOCK_M, BD], dtype=tl.float32)
        if M_TILES == 1:   # the absent tiles' places in the block helper (never updated)
            b_q1, pos1, b_m1, b_l1, b_o1 = b_q0, pos0, b_m0, b_l0, b_o0
        if M_TILES < 4:
            b_q2, pos2, b_m2, b_l2, b_o2 = b_q0, pos0, b_m0, b_l0, b_o0
            b_q3, pos3, b_m3, b_l3, b_o3 = b_q0, pos0, b_m0, b_l0, b_o0
        p_k0 = k + i_b * s_kb + i_hk * s_kh + o_d[None, :]
        p_v0 = v + i_b * s_vb + i_hk * s_vh + o_d[None, :]
        # the split's blocks up to k_hi (those past it would load nothing and leave every
        # row unchanged, see above: stopping there changes no bit), in ascending order:
        # first the blocks of committed keys only, [k_lo, c_hi) (a chain's every block; a
        # tree's blocks that end at or before start, whose logical keys are physical),
        # then a tree's blocks that reach the draft
        if TREE:
            c_hi = tl.minimum(k_hi, k_lo + tl.maximum(st - k_lo, 0) // BLOCK_N * BLOCK_N)
        else:
            c_hi = k_hi
        if EMULATE:
            # the interpreter cannot range() a runtime bound: the longest split's blocks
            # as a static loop that takes a block only below c_hi
            for j in range(0, SPLIT_BLOCKS):
                kb = k_lo + j * BLOCK_N
                if kb < c_hi:
                    (b_m0, b_l0, b_o0, b_m1, b_l1, b_o1, b_m2, b_l2, b_o2, b_m3, b_l3,
                     b_o3) = committed_block(
                        p_k0, p_v0, kb, c_hi, s_ks, s_vs, m_d, b_q0, b_q1, b_q2, b_q3,
                        pos0, pos1, pos2, pos3, b_m0, b_l0, b_o0, b_m1, b_l1, b_o1, b_m2,
                        b_l2, b_o2, b_m3, b_l3, b_o3, qk_scale, BLOCK_M, BLOCK_N, M_TILES,
                        F32_DOT, EMULATE)
        else:
            # a loop bounded at run time, which the compiler software-pipelines: the next
            # blocks' K/V are copied to shared memory (cp.async) while this one computes.
            # A static loop that takes a block only below a bound (the interpreter's form
            # above) is not pipelined: for sm_90 it compiled to plain loads, each block's
            # latency exposed (benchmarks/sm90_resources.py counts LDGSTS)
            for kb in range(k_lo, c_hi, BLOCK_N):
                (b_m0, b_l0, b_o0, b_m1, b_l1, b_o1, b_m2, b_l2, b_o2, b_m3, b_l3,
                 b_o3) = committed_block(
                    p_k0, p_v0, kb, c_hi, s_ks, s_vs, m_d, b_q0, b_q1, b_q2, b_q3,
                    pos0, pos1, pos2, pos3, b_m0, b_l0, b_o0, b_m1, b_l1, b_o1, b_m2,
                    b_l2, b_o2, b_m3, b_l3, b_o3, qk_scale, BLOCK_M, BLOCK_N, M_TILES,
                    F32_DOT, EMULATE)
        if TREE:
            for j in range(0, SPLIT_BLOCKS):
                kb = k_lo + j * BLOCK_N
                if (kb >= c_hi) & (kb < k_hi):
                    # a tree's block that reaches the draft: each node of the program
                    # gathers its own logical keys (its path's slots from start on) once
                    # and updates its rows in the tiles that hold them; every other row
                    # sees no key of that pass and stays unchanged
                    o_n = kb + tl.arange(0, BLOCK_N)
                    o_a = o_n - st                       # depth of logical key n's node
                    m_a = (o_a >= 0) & (o_a < T)
                    u = t_first
                    while u <= t_last:   # the interpreter cannot range() a runtime bound
                        slot = tl.load(paths + u * s_pt + o_a, mask=m_a, other=-1)
                        src = tl.where(o_a < 0, o_n, st + slot)   # physical cache row
                        m_n = ((o_a < 0) | (slot >= 0)) & (src >= 0) & (src < S_max)
                        m_n = m_n & (o_n < S_max)
                        m_kv = m_n[:, None] & m_d[None, :]
                        b_k = tl.load(p_k0 + src[:, None] * s_ks, mask=m_kv, other=0)
                        b_v = tl.load(p_v0 + src[:, None] * s_vs, mask=m_kv, other=0)
                        b_m0, b_l0, b_o0 = tile_gathered_block(
                            b_q0, b_k, b_v, u, o_n, m_n, o_t0, m_r0, pos0, tf0, tl0,
                            b_m0, b_l0, b_o0, qk_scale, BLOCK_M, BLOCK_N, F32_DOT, EMULATE)
                        if M_TILES > 1:
                            b_m1, b_l1, b_o1 = tile_gathered_block(
                                b_q1, b_k, b_v, u, o_n, m_n, o_t1, m_r1, pos1, tf1, tl1,
                                b_m1, b_l1, b_o1, qk_scale, BLOCK_M, BLOCK_N, F32_DOT,
                                EMULATE)
                        if M_TILES > 2:
                            b_m2, b_l2, b_o2 = tile_gathered_block(
                                b_q2, b_k, b_v, u, o_n, m_n, o_t2, m_r2, pos2, tf2, tl2,
                                b_m2, b_l2, b_o2, qk_scale, BLOCK_M, BLOCK_N, F32_DOT,
                                EMULATE)
                            b_m3, b_l3, b_o3 = tile_gathered_block(
                                b_q3, b_k, b_v, u, o_n, m_n, o_t3, m_r3, pos3, tf3, tl3,
                                b_m3, b_l3, b_o3, qk_scale, BLOCK_M, BLOCK_N, F32_DOT,
                                EMULATE)
                        u += 1
        tile_store(b_m0, b_l0, b_o0, i_b, i_s, o_t0, o_h0, m_r0, o_d, m_d, ws_m, ws_l,
                   ws_o, y, T, s_yb, s_yt, s_yh, H, D, NS, TREE)
        if M_TILES > 1:
            tile_store(b_m1, b_l1, b_o1, i_b, i_s, o_t1, o_h1, m_r1, o_d, m_d, ws_m, ws_l,
                       ws_o, y, T, s_yb, s_yt, s_yh, H, D, NS, TREE)
        if M_TILES > 2:
            tile_store(b_m2, b_l2, b_o2, i_b, i_s, o_t2, o_h2, m_r2, o_d, m_d, ws_m, ws_l,
                       ws_o, y, T, s_yb, s_yt, s_yh, H, D, NS, TREE)
            tile_store(b_m3, b_l3, b_o3, i_b, i_s, o_t3, o_h3, m_r3, o_d, m_d, ws_m, ws_l,
                       ws_o, y, T, s_yb, s_yt, s_yh, H, D, NS, TREE)


@triton.jit(do_not_specialize=["T", "s_yb", "s_pt"])  # type: ignore[untyped-decorator]  # triton ships no types
def attention_combine_kernel(  # type: ignore[no-untyped-def]  # Triton pointers are untyped
    start, paths, ws_m, ws_l, ws_o, y, T, s_pt, s_yb, s_yt, s_yh,
    H: tl.constexpr, D: tl.constexpr, NS: tl.constexpr, SPLIT: tl.constexpr,
    WIDE_FROM: tl.constexpr, WIDE: tl.constexpr, BC: tl.constexpr, BD: tl.constexpr,
    TREE: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)              # (b * T + t) * H + h
    i_h = row % H
    i_t = (row // H) % T
    i_b = row // (H * T)
    if TREE:   # node i_t sits at start + depth(i_t)
        o_one = tl.zeros([1], dtype=tl.int64) + i_t
        n_dep = tl.sum(node_depth(paths, s_pt, o_one, o_one >= 0, T, 1, 16), 0)
        pos = tl.load(start + i_b).to(tl.int64) + n_dep
    else:
        pos = tl.load(start + i_b).to(tl.int64) + i_t
    n_valid = tl.minimum(split_of(pos, SPLIT, WIDE_FROM, WIDE) + 1, NS)   # keys <= pos
    o_c = tl.arange(0, BC)
    p_m = ws_m + row * NS
    p_l = ws_l + row * NS
    p_o = ws_o + row * NS * D
    # the row's visible splits only, BC at a time from split 0 (tiles cut at absolute
    # multiples of BC: a row's tiles and their masks depend on its position alone)
    b_mx = tl.full([BC], NEG_INF, dtype=tl.float32)
    s0 = n_valid * 0
    while s0 < n_valid:   # the interpreter cannot range() a runtime bound
        o_s = s0 + o_c
        b_mx = tl.maximum(b_mx, tl.load(p_m + o_s, mask=o_s < n_valid, other=NEG_INF))
        s0 += BC
    b_max = tl.max(b_mx, 0)                          # finite: split 0 holds key 0 <= pos
    o_d = tl.arange(0, BD)
    m_d = o_d < D
    b_l = tl.sum(tl.zeros([BC], dtype=tl.float32), 0)
    b_o = tl.zeros([BD], dtype=tl.float32)
    s0 = n_valid * 0
    while s0 < n_valid:   # ascending tiles; a tile's splits summed by one fixed reduction
        o_s = s0 + o_c
        m_s = o_s < n_valid                          # the other splits add exact zeros
        b_w = tl.math.exp2(tl.load(p_m + o_s, mask=m_s, other=NEG_INF) - b_max)   # [BC]
        b_l += tl.sum(b_w * tl.load(p_l + o_s, mask=m_s, other=0), 0)
        b_ot = tl.load(p_o + o_s[:, None] * D + o_d[None, :],
                       mask=m_s[:, None] & m_d[None, :], other=0)                  # [BC, BD]
        b_o += tl.sum(b_w[:, None] * b_ot, 0)
        s0 += BC
    b_y = b_o / b_l
    p_y = y + i_b * s_yb + i_t * s_yt + i_h * s_yh + o_d
    tl.store(p_y, b_y.to(y.dtype.element_ty), mask=m_d)


def split_count(S_max: int, split_keys: int = SPLIT_KEYS, wide_from: int = WIDE_FROM,
                wide_keys: int = WIDE_KEYS) -> int:
    """The key splits covering cache rows ``0 .. S_max - 1``: ``split_keys``-key splits
    below ``wide_from``, ``wide_keys``-key splits from there."""
    if S_max <= wide_from:
        return -(-S_max // split_keys)
    return wide_from // split_keys - (-(S_max - wide_from) // wide_keys)


def row_tiles_for(rows: int, most: int = MAX_ROW_TILES) -> int:
    """Row tiles per program for ``rows`` query rows of one KV head (``G * T``): all of
    its 16-row tiles, rounded up to a power of two, at most ``most`` (1, 2 or 4)."""
    tiles = -(-rows // BLOCK_M)
    return min(most, int(triton.next_power_of_2(max(1, tiles))))


def launch_decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, start: torch.Tensor,
    scale: float, out: torch.Tensor | None, *, num_warps: int | None = None, num_stages: int = 2,
    split_keys: int = SPLIT_KEYS, block_n: int = BLOCK_N, paths: torch.Tensor | None = None,
    combine_splits: int = COMBINE_SPLITS, wide_from: int = WIDE_FROM, wide_keys: int = WIDE_KEYS,
    row_tiles: int | None = None,
) -> torch.Tensor:
    """Launch both passes on validated inputs; returns ``out`` (``[B, T, H, D]``).

    ``split_keys`` / ``block_n`` / ``combine_splits`` / ``wide_from`` / ``wide_keys``
    override :data:`SPLIT_KEYS` / :data:`BLOCK_N` / :data:`COMBINE_SPLITS` /
    :data:`WIDE_FROM` / :data:`WIDE_KEYS` (tests of the boundaries at small sizes,
    benchmark sweeps): ``block_n`` divides ``split_keys`` and ``wide_keys``,
    ``split_keys`` divides ``wide_from``, ``combine_splits`` is a power of two. Results
    are M-invariant for any fixed set, not across sets.
    ``paths`` (int32 ``[T, T]`` with unit column stride, ``B == 1``, validated by the
    caller): a tree verify;
    ``None``: a chain (the ``TREE=False`` specialisation, whose arithmetic the tree code
    leaves untouched). The table's contents are read on the device only.
    ``row_tiles`` (1, 2 or 4): the 16-row tiles a program holds; default
    :func:`row_tiles_for` (a KV head's tiles, up to :data:`MAX_ROW_TILES`).
    Any value gives the same bits: a tile's arithmetic does not depend on its neighbours.
    ``num_warps``: default :data:`WARPS_FOR_TILES`; any value gives the same bits.
    """
    if split_keys % block_n != 0 or wide_keys % block_n != 0:
        raise ValueError(f"'block_n'={block_n} must divide 'split_keys'={split_keys} and "
                         f"'wide_keys'={wide_keys}")
    if wide_from % split_keys != 0:
        raise ValueError(f"'split_keys'={split_keys} must divide 'wide_from'={wide_from}")
    if combine_splits < 1 or combine_splits & (combine_splits - 1):
        raise ValueError(f"'combine_splits' must be a power of two (got {combine_splits})")
    B, T, H, D = q.shape
    HKV, S_max = k_cache.shape[1], k_cache.shape[2]
    G = H // HKV
    tiles = triton.cdiv(G * T, BLOCK_M)
    if row_tiles is None:
        row_tiles = row_tiles_for(G * T)
    elif row_tiles not in (1, 2, 4):
        raise ValueError(f"'row_tiles' must be 1, 2 or 4 (got {row_tiles})")
    if num_warps is None:
        num_warps = WARPS_FOR_TILES[row_tiles]
    if out is None:
        out = torch.empty_like(q)
    NS = split_count(S_max, split_keys, wide_from, wide_keys)
    BD = max(16, triton.next_power_of_2(D))
    if NS > 1:
        rows = B * T * H
        ws_m = torch.empty(rows, NS, dtype=torch.float32, device=q.device)
        ws_l = torch.empty(rows, NS, dtype=torch.float32, device=q.device)
        ws_o = torch.empty(rows, NS, D, dtype=torch.float32, device=q.device)
    else:
        ws_m = ws_l = ws_o = out
    grid = (triton.cdiv(tiles, row_tiles), NS, B * HKV)
    tree = paths is not None
    # a chain passes `start` for the table it never reads (a valid pointer of a fixed type)
    table = paths if paths is not None else start
    s_pt = paths.stride(0) if paths is not None else 0
    attention_split_kernel[grid](
        q, k_cache, v_cache, start, table, ws_m, ws_l, ws_o, out,
        scale * LOG2E, T, S_max, s_pt,
        q.stride(0), q.stride(1), q.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        H=H, HKV=HKV, D=D, NS=NS, SPLIT=split_keys, WIDE_FROM=wide_from, WIDE=wide_keys,
        BLOCK_M=BLOCK_M, BLOCK_N=block_n,
        BD=BD, TREE=tree, M_TILES=row_tiles,
        # the longest split's blocks (a cache that ends below wide_from has no wide split)
        SPLIT_BLOCKS=(max(split_keys, wide_keys) if S_max > wide_from else split_keys) // block_n,
        F32_DOT=q.dtype == torch.float32, EMULATE=INTERPRET,
        num_warps=num_warps, num_stages=num_stages,
    )
    if NS > 1:
        attention_combine_kernel[(B * T * H,)](
            start, table, ws_m, ws_l, ws_o, out, T, s_pt,
            out.stride(0), out.stride(1), out.stride(2),
            H=H, D=D, NS=NS, SPLIT=split_keys, WIDE_FROM=wide_from, WIDE=wide_keys,
            BC=combine_splits, BD=BD, TREE=tree,
            num_warps=4,
        )
    return out
