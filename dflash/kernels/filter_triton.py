"""Triton kernels of :func:`~dflash.kernels.filter.filter_floors` for 16-bit logits
(bfloat16 or float16): the filters' floors without ordering the vocabulary.

A 16-bit logit has 65,536 possible values, so a row's order (logit descending, then id) is
a histogram of its tokens over those values, read from the top. Only the tokens that can
decide a cut are counted: global atomics cost about 30 µs per million tokens on an H200,
so counting a whole 248,320-token vocabulary for 16 rows would cost over 100 µs. Each
launch is a phase that needs the one before it in every program of a row, so a row's
small reductions are folded into the launch after them (every program of that launch
repeats the reduction; program 0 of the row stores it): six launches with top-k, eight
with top-p alone, no memset.

1. ``filter_maxima_kernel`` (``[T, chunks]``): the top bin of each group of 256 tokens;
   the programs also zero the row's histogram.
2. ``filter_bound_kernel`` (one program per row), with top-k: the row's top bin (the
   scaled logit ``m`` every weight is relative to) and the lowest bin that can matter:
   the ``k``-th largest group maximum (``k`` tokens lie at or above it, so the ``k``-th
   token does). Without top-k the bound is 0 (every token), and top-p alone finds the top
   bin in its table launch.
3. Top-p alone, whose cut may lie deep in a flat row (:func:`launch_filter_nucleus`):
   ``filter_table_kernel`` (``[T, 65536 / 1024]``) finds the row's top bin from the group
   maxima and writes, for each of the 65,536 patterns, its top-p weight, its bucket (one
   of 64 slices of ``s - m``) and its min-p flag. Every token of a pattern has that entry,
   so the float64 ``exp`` runs once per pattern (none for a block of patterns 22.25 or
   more below the top, which weigh 0), not once per token and level. Then two levels of
   ``filter_mass_kernel`` (``[T, chunks]``) gather each token's entry: level 0 sums
   every weight by eighth of the buckets (integer sums in per-lane accumulators, exact in
   any order) and min-p's lowest kept bin; level 1 first finds the eighth where the
   running mass reaches ``top_p * Z`` from level 0's partials (:func:`_cut`), then sums
   that eighth's tokens by bucket. A block of tokens that adds nothing (level 0: every
   weight 0; level 1: none in the eighth) skips the sums. The histogram launch finds the
   bucket and the mass above it from level 1's partials; only that bucket's tokens are
   counted, and the highest bin counted is where the scan starts.
4. ``filter_hist_kernel`` (``[T, chunks]``): each token that can matter adds one to the
   bin of its logit's bits, mapped to an order-preserving index (``-0.0`` counted as
   ``+0.0``). Integer atomics: the counts do not depend on the order they land in.
5. ``filter_scan_kernel`` (one program per row): walks the bins from the top (top-p
   alone: from the cut's bucket, the mass above it known), in blocks, carrying integer
   sums. Every token of a bin has the same logit, hence the same scaled score and top-p
   weight, so a bin's weight is its count times one token's. The walk finds the bin where
   top-k's count reaches ``k`` and the bin where top-p's mass reaches ``top_p * Z``, and
   min-p's lowest kept bin, and leaves the cut's bin and its rank among the bin's tokens
   (or, when min-p is the strictest, the finished floor). A min-p floor under the
   histogram's bound is never the strictest: the cut of top-k lies above it.
6. ``filter_ties_count_kernel`` (``[T, chunks]``): how many tokens of each chunk lie in the
   cut's bin.
7. ``filter_ties_pick_kernel`` (``[T, chunks]``): the chunk that holds the cut's rank finds
   the token (ties are ordered by id) and writes its id.

Each row's result depends on that row alone (M-invariance) and equals the torch
reference's (``filter_reference.py``), whose weights use the same float64 ``exp``: every
launch is compiled without contracting ``l * inv_t - m`` into one FMA rounding
(:data:`EXACT`), so the scaled logits are the reference's float32 products, bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

#: tokens per program of the histogram and tie launches
CHUNK = 4096
#: one bin per 16-bit pattern
NBINS = 1 << 16
#: bins per step of the scan
SCAN_BLOCK = 4096
#: groups per chunk whose top bins bound the histogram from below
GROUPS = 16
#: top-p's coarse buckets of scaled logits below the top (equal slices of 22.25)
BUCKETS = 64
#: tokens per program of the mass pass
MASS_CHUNK = 4096
#: tokens per step of the mass pass
MASS_BLOCK = 512
#: warps per program of the mass pass
MASS_WARPS = 4
#: patterns per program of top-p's table
TABLE_BLOCK = 1024
#: every launch compiles its float operations as written: ``s * inv_t - m`` is not fused
#: into one rounding (an FMA), so a weight is the reference's, bit for bit
EXACT: dict[str, bool] = {"enable_fp_fusion": False}


@triton.jit
def _bin_of(bits):  # type: ignore[no-untyped-def]  # Triton values are untyped
    """The order-preserving bin of 16-bit float patterns (int32 in [0, 65536))."""
    u = tl.where(bits == 0x8000, 0, bits)  # -0.0 is +0.0
    return tl.where(u < 0x8000, u + 0x8000, 0xFFFF - u)


@triton.jit  # type: ignore[untyped-decorator]  # triton ships no types
def _logit_of(b, IS_BF16: tl.constexpr):  # type: ignore[no-untyped-def]  # untyped values
    """The float32 logit of bins ``b`` (int32), the inverse of :func:`_bin_of`."""
    u = tl.where(b >= 0x8000, b - 0x8000, 0xFFFF - b)
    if IS_BF16:
        x = (u << 16).to(tl.float32, bitcast=True)
    else:
        x = u.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return x + 0.0


@triton.jit
def _weight(s, m):  # type: ignore[no-untyped-def]  # Triton values are untyped
    """``floor(exp(float64(s - m)) * 2**32)`` as int64 (a NaN or positive difference is 0)."""
    d = s - m
    d = tl.where(d != d, 0.0, d)
    d = tl.minimum(d, 0.0)
    e = tl.exp(d.to(tl.float64))
    return tl.floor(e * 4294967296.0).to(tl.int64)


@triton.jit  # type: ignore[untyped-decorator]  # triton ships no types
def filter_maxima_kernel(  # type: ignore[no-untyped-def]  # Triton pointers are untyped
    bits16, maxima, hist,  # [T, V] int16 (the logits' bits); [T, chunks * SUB] i32; [T, NBINS]
    V, chunks, BV: tl.constexpr, SUB: tl.constexpr,
):
    """The top bin of each group of ``BV // SUB`` tokens; the row's ``chunks`` programs
    also zero its histogram, ``BV`` bins at a time (no memset launch before the
    histogram's)."""
    i_t = tl.program_id(0).to(tl.int64)
    i_c = tl.program_id(1)
    o_v = i_c * BV + tl.arange(0, BV)
    m_v = o_v < V
    u = tl.load(bits16 + i_t * V + o_v, mask=m_v, other=0).to(tl.int32) & 0xFFFF
    b = tl.reshape(tl.where(m_v, _bin_of(u), -1), [SUB, BV // SUB])
    o_s = tl.arange(0, SUB)
    tl.store(maxima + (i_t * chunks + i_c) * SUB + o_s, tl.max(b, 1))
    o_b = tl.arange(0, BV)
    z = i_c * BV
    while z < 65536:
        tl.store(hist + i_t * 65536 + z + o_b, tl.zeros([BV], dtype=tl.int32))
        z += chunks * BV


@triton.jit  # type: ignore[untyped-decorator]  # triton ships no types
def filter_bound_kernel(  # type: ignore[no-untyped-def]  # Triton pointers are untyped
    maxima, tops, bound,  # [T, n] int32 (the groups' top bins); [T] int32; [T] int32
    n, top_k,
    HAS_K: tl.constexpr, BN: tl.constexpr,
):
    i_t = tl.program_id(0).to(tl.int64)
    o = tl.arange(0, BN)
    x = tl.load(maxima + i_t * n + o, mask=o < n, other=-1)
    top = tl.max(x, 0)
    b = 0  # every token
    if HAS_K:  # noqa: SIM102  # a compile-time branch around a run-time one
        # the k-th largest group maximum: k tokens lie at or above it, so the k-th token does
        if top_k <= n:
            ranked = tl.sort(x, descending=True)
            b = tl.sum(tl.where(o == top_k - 1, ranked, 0), 0)
    tl.store(tops + i_t, top)
    tl.store(bound + i_t, b)


@triton.jit  # type: ignore[untyped-decorator]  # triton ships no types
def _bucket(s, m, NB: tl.constexpr):  # type: ignore[no-untyped-def]  # untyped values
    """Top-p's coarse bucket of scaled logits ``s`` below the top ``m``: ``NB`` equal
    slices of ``[m - 22.25, m]`` (every weight below weighs 0, and lands in the last)."""
    d = s - m
    d = tl.where(d != d, 0.0, d)
    k = tl.minimum(tl.maximum(-d, 0.0) * (NB / 22.25), NB - 1.0)
    return tl.floor(k).to(tl.int32)


@triton.jit  # type: ignore[untyped-decorator]  # triton ships no types
def _partials(masses, i_t, chunks, BC: tl.constexpr):  # type: ignore[no-untyped-def]  # untyped values
    """A row's mass by eighth: the sum of its ``chunks`` partials ``[8]`` (int64, exact)."""
    o_c = tl.arange(0, BC)
    o_8 = tl.arange(0, 8)
    p_m = masses + (i_t * chunks + o_c[:, None]) * 8 + o_8[None, :]
    return tl.sum(tl.load(p_m, mask=(o_c < chunks)[:, None], other=0), 0)


@triton.jit
def _cut(per, start, z, top_p):  # type: ignore[no-untyped-def]  # Triton values are untyped
    """The first of 8 slices ``per`` (int64 masses, in order) where the running mass from
    ``start`` reaches ``top_p * z`` (the last when none does), and the mass above it."""
    o_8 = tl.arange(0, 8)
    cum = start + tl.cumsum(per, 0)
    target = top_p * z.to(tl.float64)
    first = tl.min(tl.where((cum.to(tl.float64) >= target) & (per > 0), o_8, 8), 0)
    first = tl.minimum(first, 7)
    return first, tl.sum(tl.where(o_8 == first, cum - per, 0), 0)


@triton.jit  # type: ignore[untyped-decorator]  # triton ships no types
def filter_table_kernel(  # type: ignore[no-untyped-def]  # Triton pointers are untyped
    maxima, tops, table,  # [T, n] int32 (the groups' top bins); [T] int32; [T, NBINS] int64
    inv_t, log_min_p, n,
    HAS_MIN_P: tl.constexpr, IS_BF16: tl.constexpr, TB: tl.constexpr, NB: tl.constexpr,
    BN: tl.constexpr,
):
    """What top-p needs of each of the 65,536 16-bit patterns, relative to the row's top
    bin (found here from the ``n`` group ``maxima``; program 0 of the row stores it in
    ``tops``): ``table[t, u]`` packs the top-p weight (bits 0-39, :func:`_weight`), the
    bucket of ``s - m`` (bits 40-45, :func:`_bucket`) and whether min-p keeps the pattern
    (bit 48). Every token of a pattern has the same entry, so the mass launches gather it
    instead of computing a float64 ``exp`` per token. A block of patterns that all weigh 0
    (22.25 or more below the top) computes no ``exp``."""
    tl.static_assert(NB == 64, "a bucket is 6 bits; the mass levels split 64 into 8 eighths")
    i_t = tl.program_id(0).to(tl.int64)
    i_b = tl.program_id(1)
    o_n = tl.arange(0, BN)
    top = tl.max(tl.load(maxima + i_t * n + o_n, mask=o_n < n, other=-1), 0)
    if i_b == 0:
        tl.store(tops + i_t, top)
    m = _logit_of(top, IS_BF16) * inv_t
    u = i_b * TB + tl.arange(0, TB)
    s = _logit_of(_bin_of(u), IS_BF16) * inv_t
    d = s - m
    w = tl.zeros([TB], dtype=tl.int64)
    # 22.25 below the top or further a pattern weighs 0: exp(-22.25) * 2**32 < 1
    if tl.max(((d != d) | (d >= -22.25)).to(tl.int32), 0) > 0:
        w = _weight(s, m)  # int64 in [0, 2**32]
    e = w | (_bucket(s, m, NB).to(tl.int64) << 40)
    if HAS_MIN_P:
        e = e | ((s >= m + log_min_p).to(tl.int64) << 48)
    tl.store(table + i_t * 65536 + u, e)


@triton.jit  # type: ignore[untyped-decorator]  # triton ships no types
def filter_mass_kernel(  # type: ignore[no-untyped-def]  # Triton pointers are untyped
    bits16, table, masses, lowest,  # [T, V] i16; [T, NBINS] i64; [T, chunks, 8] i64; [T, chunks]
    prior, coarse, above, total, least, cut_top,  # [T, chunks, 8] i64; [T] i32 i64 i64 i32
    top_p, V,  # cut_top [T] i32
    LEVEL: tl.constexpr, HAS_MIN_P: tl.constexpr, BV: tl.constexpr, BS: tl.constexpr,
    BC: tl.constexpr,
):
    """One level of top-p's mass: every token's weight (gathered from the row's ``table``,
    :func:`filter_table_kernel`) summed by eighth of the 64 buckets of ``s - m`` into
    ``masses`` — level 0: by bucket ``// 8`` (every token; and min-p's lowest kept bin
    into ``lowest``); level 1: by bucket ``% 8``, the tokens of the row's coarse eighth
    only. Integer sums, exact in any order; the sums stay in per-lane accumulators until
    the chunk's end.

    Level 1 first finishes level 0, in every program: it sums level 0's partials
    (``prior``) into ``Z`` and finds the coarse eighth, the mass above it and min-p's
    lowest kept bin. Program 0 of the row stores them (``total``, ``coarse``, ``above``,
    ``least``) for the launches after, and sets ``cut_top`` (the highest bin the histogram
    counts, raised by its programs) to -1."""
    i_t = tl.program_id(0).to(tl.int64)
    i_c = tl.program_id(1)
    chunks = tl.num_programs(1)
    o_8 = tl.arange(0, 8)
    inside = -1
    if LEVEL == 1:
        per = _partials(prior, i_t, chunks, BC)
        z = tl.sum(per, 0)
        inside, mass_above = _cut(per, tl.zeros([], dtype=tl.int64), z, top_p)
        if i_c == 0:
            tl.store(total + i_t, z)
            tl.store(coarse + i_t, inside)
            tl.store(above + i_t, mass_above)
            tl.store(cut_top + i_t, -1)
            if HAS_MIN_P:
                o_c = tl.arange(0, BC)
                x = tl.load(lowest + i_t * chunks + o_c, mask=o_c < chunks, other=65536)
                tl.store(least + i_t, tl.min(x, 0))
    acc = tl.zeros([8, BS], dtype=tl.int64)
    low = 65536
    for sub in range(0, BV, BS):
        o_v = i_c * BV + sub + tl.arange(0, BS)
        m_v = o_v < V
        u = tl.load(bits16 + i_t * V + o_v, mask=m_v, other=0).to(tl.int32) & 0xFFFF
        e = tl.load(table + i_t * 65536 + u)
        w = e & 0xFFFFFFFFFF
        k = ((e >> 40) & 63).to(tl.int32)
        if LEVEL == 0:  # a compile-time branch: each level compiles one arm
            key = tl.where(m_v & (w > 0), k >> 3, 8)
            if HAS_MIN_P:
                kept = m_v & (((e >> 48) & 1) != 0)
                low = tl.minimum(low, tl.min(tl.where(kept, _bin_of(u), 65536), 0))
        else:
            key = tl.where(m_v & ((k >> 3) == inside), k & 7, 8)
        # a block whose every token weighs 0 (level 0) or lies outside the coarse eighth
        # (level 1) adds nothing
        if tl.min(key, 0) < 8:
            acc += tl.where(key[None, :] == o_8[:, None], w[None, :], 0)
    tl.store(masses + ((i_t * chunks + i_c) * 8) + o_8, tl.sum(acc, 1))
    if LEVEL == 0:
        tl.store(lowest + i_t * chunks + i_c, low)


@triton.jit  # type: ignore[untyped-decorator]  # triton ships no types
def filter_hist_kernel(  # type: ignore[no-untyped-def]  # Triton pointers are untyped
    bits16, bound, high, hist,  # [T, V] i16; [T] i32; [T, NBINS, 2] i32; [T, NBINS] i32, zeroed
    masses, coarse, prior_above, total, bucket, above, cut_top,  # top-p alone: level 1's
    top_p, V, parts,  # partials [T, parts, 8] i64, [T] i32 i64 i64; out: [T] i32 i64 i32
    COARSE: tl.constexpr, BV: tl.constexpr, BC: tl.constexpr,
):
    """Count each token that can matter into the bin of its logit. Top-p alone
    (``COARSE``) first finishes the second mass level, in every program: the bucket where
    the running mass reaches ``top_p * Z`` inside the coarse eighth, and the mass above it
    (program 0 of the row stores them: ``bucket``, ``above``); only that bucket's tokens
    count (a token's bucket: bits 8-13 of the high word of its pattern's entry in the row's
    table, ``high``: the table viewed as int32 pairs), and each program raises ``cut_top``
    to the highest bin it counts, where the scan's walk starts."""
    i_t = tl.program_id(0).to(tl.int64)
    o_v = tl.program_id(1) * BV + tl.arange(0, BV)
    m_v = o_v < V
    u = tl.load(bits16 + i_t * V + o_v, mask=m_v, other=0).to(tl.int32) & 0xFFFF
    b = _bin_of(u)
    if COARSE:
        per = _partials(masses, i_t, parts, BC)
        first, mass_above = _cut(per, tl.load(prior_above + i_t), tl.load(total + i_t), top_p)
        cut = tl.load(coarse + i_t) * 8 + first
        if tl.program_id(1) == 0:
            tl.store(bucket + i_t, cut)
            tl.store(above + i_t, mass_above)
        k = (tl.load(high + (i_t * 65536 + u) * 2 + 1, mask=m_v, other=0) >> 8) & 63
        m_b = m_v & (k == cut)
        tl.atomic_max(cut_top + i_t, tl.max(tl.where(m_b, b, -1), 0), sem="relaxed")
    else:
        m_b = m_v & (b >= tl.load(bound + i_t))
    tl.atomic_add(hist + i_t * 65536 + b, 1, mask=m_b, sem="relaxed")


@triton.jit  # type: ignore[untyped-decorator]  # triton ships no types
def filter_scan_kernel(  # type: ignore[no-untyped-def]  # Triton pointers are untyped
    hist, tops, above, totals, least, cut_top,  # [T, NBINS] i32; [T] i32, i64, i64, i32, i32
    floor, floor_id, cut_bin, cut_rank,  # [T] f32, i64, i32, i64
    inv_t, top_k, top_p, log_min_p, V,
    HAS_K: tl.constexpr, HAS_P: tl.constexpr, HAS_MIN_P: tl.constexpr,
    COARSE: tl.constexpr, IS_BF16: tl.constexpr, BB: tl.constexpr,
):
    i_t = tl.program_id(0).to(tl.int64)
    p_h = hist + i_t * 65536
    o = tl.arange(0, BB)
    top = tl.load(tops + i_t)  # the row's top bin: m is its scaled logit
    m = _logit_of(top, IS_BF16) * inv_t
    start = (top // BB + 1) * BB  # the walks begin with the top bin's block
    cut = top
    rank = tl.zeros([], dtype=tl.int64) + 1
    total = tl.zeros([], dtype=tl.int64)  # top-p's Z
    if HAS_K:
        # the bin where the running count reaches k; Z: the weights of the first k tokens
        run_c = tl.zeros([], dtype=tl.int64)
        run_w = tl.zeros([], dtype=tl.int64)
        found = 0
        hi = start
        while (found == 0) & (hi > 0):
            b = hi - 1 - o
            c = tl.load(p_h + b).to(tl.int64)
            cc = run_c + tl.cumsum(c, 0)
            first = tl.min(tl.where((cc >= top_k) & (c > 0), o, BB), 0)
            sel = o == first
            if first < BB:
                found = 1
                cut = hi - 1 - first
                rank = top_k - tl.sum(tl.where(sel, cc - c, 0), 0)
            if HAS_P:  # Z of the k kept tokens: the weights before the cut's bin, and rank
                w = _weight(_logit_of(b, IS_BF16) * inv_t, m)
                cw = c * w
                if first < BB:
                    w_before = tl.sum(tl.where(sel, run_w + tl.cumsum(cw, 0) - cw, 0), 0)
                    total = w_before + rank * tl.sum(tl.where(sel, w, 0), 0)
                run_w += tl.sum(cw, 0)
            run_c += tl.sum(c, 0)
            hi -= BB
    elif HAS_P:
        total = tl.load(totals + i_t)  # Z: every weight, summed by the mass pass
    if HAS_P:
        # the first bin where the running mass of the kept tokens reaches top_p * Z
        target = top_p * total.to(tl.float64)
        k_bin = cut
        k_rank = rank
        run_w = tl.zeros([], dtype=tl.int64)
        hi = start
        if COARSE:  # the histogram holds the cut's bucket only: the mass above it is known,
            run_w = tl.load(above + i_t)  # and the walk starts at the bucket's highest bin
            highest = tl.load(cut_top + i_t)
            if highest >= 0:
                hi = (highest // BB + 1) * BB
        found = 0
        while (found == 0) & (hi > 0):
            b = hi - 1 - o
            c = tl.load(p_h + b).to(tl.int64)
            if HAS_K:
                c = tl.where(b > k_bin, c, tl.where(b == k_bin, k_rank, 0))
            # a block of empty bins adds nothing (the tiny magnitudes a bucket straddling
            # zero spans, thousands of bins): its float64 weights are not computed
            if tl.max(c, 0) > 0:
                w = _weight(_logit_of(b, IS_BF16) * inv_t, m)
                cw = c * w
                cum = run_w + tl.cumsum(cw, 0)
                first = tl.min(tl.where((cum.to(tl.float64) >= target) & (c > 0), o, BB), 0)
                sel = o == first
                if first < BB:
                    found = 1
                    cut = hi - 1 - first
                    before = tl.sum(tl.where(sel, cum - cw, 0), 0)
                    w_cut = tl.maximum(tl.sum(tl.where(sel, w, 0), 0), 1)
                    # the smallest r >= 1 with before + r * w_cut >= target, exact in float64
                    need = (target - before.to(tl.float64)) / w_cut.to(tl.float64)
                    r = tl.maximum(tl.ceil(need), 1.0).to(tl.int64)
                    below = (before + (r - 1) * w_cut).to(tl.float64) >= target
                    r = tl.where((r > 1) & below, r - 1, r)
                    r = tl.where((before + r * w_cut).to(tl.float64) < target, r + 1, r)
                    rank = r
                run_w += tl.sum(cw, 0)
            hi -= BB
    done = 0
    if HAS_MIN_P:
        # min-p's floor: the lowest nonempty bin whose scaled logit reaches m + log(min_p)
        lowest = top
        if COARSE:  # found by the mass pass, which sees every token
            lowest = tl.load(least + i_t)
        else:
            low = m + log_min_p
            hi = start
            go = 1
            while go != 0:
                b = hi - 1 - o
                c = tl.load(p_h + b)
                s = _logit_of(b, IS_BF16) * inv_t
                kept = (c > 0) & (s >= low)
                lowest = tl.minimum(lowest, tl.min(tl.where(kept, b, 65536), 0))
                hi -= BB
                go = tl.where((hi > 0) & (tl.min(s, 0) >= low), 1, 0)
        if (HAS_K | HAS_P) == 0:
            done = 1
        if lowest > cut:
            done = 1
        if done != 0:
            cut = lowest
    tl.store(floor + i_t, _logit_of(cut, IS_BF16))
    tl.store(cut_bin + i_t, cut)
    if done != 0:
        tl.store(floor_id + i_t, tl.zeros([], dtype=tl.int64) + (V - 1))
        tl.store(cut_rank + i_t, 0)
    else:
        tl.store(cut_rank + i_t, rank)


@triton.jit  # type: ignore[untyped-decorator]  # triton ships no types
def filter_ties_count_kernel(  # type: ignore[no-untyped-def]  # Triton pointers are untyped
    bits16, cut_bin, cut_rank, counts,  # [T, V] i16; [T] i32, i64; [T, chunks] i32
    V, chunks, BV: tl.constexpr,
):
    i_t = tl.program_id(0).to(tl.int64)
    i_c = tl.program_id(1)
    n = 0
    if tl.load(cut_rank + i_t) > 0:
        o_v = i_c * BV + tl.arange(0, BV)
        m_v = o_v < V
        u = tl.load(bits16 + i_t * V + o_v, mask=m_v, other=0).to(tl.int32) & 0xFFFF
        n = tl.sum((m_v & (_bin_of(u) == tl.load(cut_bin + i_t))).to(tl.int32), 0)
    tl.store(counts + i_t * chunks + i_c, n)


@triton.jit  # type: ignore[untyped-decorator]  # triton ships no types
def filter_ties_pick_kernel(  # type: ignore[no-untyped-def]  # Triton pointers are untyped
    bits16, cut_bin, cut_rank, counts, floor_id,  # ...; [T, chunks] i32; [T] i64
    V, chunks, BV: tl.constexpr, BC: tl.constexpr,
):
    i_t = tl.program_id(0).to(tl.int64)
    i_c = tl.program_id(1)
    rank = tl.load(cut_rank + i_t)
    o_c = tl.arange(0, BC)
    n_c = tl.load(counts + i_t * chunks + o_c, mask=o_c < chunks, other=0).to(tl.int64)
    before = tl.sum(tl.where(o_c < i_c, n_c, 0), 0)
    mine = tl.sum(tl.where(o_c == i_c, n_c, 0), 0)
    if (rank > before) & (rank <= before + mine):
        o_v = i_c * BV + tl.arange(0, BV)
        m_v = o_v < V
        u = tl.load(bits16 + i_t * V + o_v, mask=m_v, other=0).to(tl.int32) & 0xFFFF
        tie = (m_v & (_bin_of(u) == tl.load(cut_bin + i_t))).to(tl.int64)
        at = tl.min(tl.where((tie > 0) & (tl.cumsum(tie, 0) == rank - before), o_v, V), 0)
        tl.store(floor_id + i_t, at.to(tl.int64))


def launch_filter_nucleus(
    bits16: torch.Tensor, maxima: torch.Tensor, inv_temperature: float, top_p: float,
    log_min_p: float | None, is_bf16: bool, *, chunk: int | None = None,
    block: int | None = None, warps: int | None = None,
) -> dict[str, torch.Tensor]:
    """Top-p alone's table and two mass launches over ``bits16: [T, V]`` (the 16-bit
    logits' bits) with the rows' group maxima ``maxima: [T, n]``
    (:func:`filter_maxima_kernel`). Returns the tensors the histogram and the scan read:
    ``tops`` ``[T]`` int32 (the rows' top bins), ``table`` ``[T, NBINS]`` int64 (each
    pattern's weight, bucket and min-p flag: :func:`filter_table_kernel`), ``masses``
    ``[T, parts, 8]`` int64 (level 1's partials inside the coarse eighth), ``coarse``
    ``[T]`` int32 (that eighth of the :data:`BUCKETS` buckets of ``s - m``), ``above``
    ``[T]`` int64 (the mass above it), ``total`` ``[T]`` int64 (``Z``) and ``least``
    ``[T]`` int32 (min-p's lowest kept bin; ``log_min_p`` is ``log(min_p)``, None when
    off, and ``least`` is then unwritten) and ``cut_top`` ``[T]`` int32 (-1, raised by the
    histogram to the highest bin it counts). ``chunk`` (tokens per program), ``block``
    (tokens per step) and ``warps`` of the mass launches default to the measured best
    (:data:`MASS_CHUNK`, :data:`MASS_BLOCK`, :data:`MASS_WARPS`); every choice gives the
    same integers (``masses`` summed over its parts)."""
    chunk, block = chunk or MASS_CHUNK, block or MASS_BLOCK
    T, V = bits16.shape
    n = maxima.shape[1]
    device = bits16.device
    parts = triton.cdiv(V, chunk)

    def ints(*shape: int, dtype: torch.dtype = torch.int32) -> torch.Tensor:
        return torch.empty(*shape, dtype=dtype, device=device)

    out = {
        "tops": ints(T), "table": ints(T, NBINS, dtype=torch.int64),
        "masses": ints(T, parts, 8, dtype=torch.int64), "coarse": ints(T),
        "above": ints(T, dtype=torch.int64), "total": ints(T, dtype=torch.int64),
        "least": ints(T), "cut_top": ints(T),
    }
    filter_table_kernel[(T, NBINS // TABLE_BLOCK)](
        maxima, out["tops"], out["table"], inv_temperature, log_min_p or 0.0, n,
        HAS_MIN_P=log_min_p is not None, IS_BF16=is_bf16, TB=TABLE_BLOCK, NB=BUCKETS,
        BN=block_of(n), num_warps=4, **EXACT,
    )
    prior, lowest = ints(T, parts, 8, dtype=torch.int64), ints(T, parts)
    for level, masses in ((0, prior), (1, out["masses"])):
        filter_mass_kernel[(T, parts)](
            bits16, out["table"], masses, lowest, prior, out["coarse"], out["above"],
            out["total"], out["least"], out["cut_top"], top_p, V,
            LEVEL=level, HAS_MIN_P=log_min_p is not None, BV=chunk, BS=block,
            BC=block_of(parts), num_warps=warps or MASS_WARPS, **EXACT,
        )
    return out


def block_of(n: int) -> int:
    """The lanes of a block that holds ``n`` entries: a power of two, at least 16."""
    return max(16, 1 << (n - 1).bit_length())


def launch_filter_floors(
    logits: torch.Tensor, inv_temperature: float, top_k: int, top_p: float, min_p: float,
    floor: torch.Tensor, floor_id: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the kernels on validated inputs: ``logits`` contiguous ``[T, V]`` bfloat16
    or float16, at least one filter on (``0 < top_k < V``, ``top_p < 1`` or
    ``min_p > 0``); the floors land in ``floor`` / ``floor_id``."""
    import math

    T, V = logits.shape
    device = logits.device
    bits16 = logits.view(torch.int16)
    chunks = triton.cdiv(V, CHUNK)
    has_k, has_p, has_min_p = 0 < top_k < V, top_p < 1.0, min_p > 0.0
    coarse = has_p and not has_k
    is_bf16 = logits.dtype == torch.bfloat16
    log_min_p = math.log(min_p) if has_min_p else 0.0

    def ints(*shape: int, dtype: torch.dtype = torch.int32) -> torch.Tensor:
        return torch.empty(*shape, dtype=dtype, device=device)

    hist = ints(T, NBINS)  # zeroed by the maxima launch
    n = chunks * GROUPS
    maxima, bound, cut_bin, counts = ints(T, n), ints(T), ints(T), ints(T, chunks)
    cut_rank = ints(T, dtype=torch.int64)
    filter_maxima_kernel[(T, chunks)](
        bits16, maxima, hist, V, chunks, BV=CHUNK, SUB=GROUPS, num_warps=4, **EXACT
    )
    if coarse:  # the top bins come from the first mass launch; the bound is not read
        m = launch_filter_nucleus(
            bits16, maxima, inv_temperature, top_p, log_min_p if has_min_p else None, is_bf16
        )
        tops, high, parts = m["tops"], m["table"].view(torch.int32), m["masses"].shape[1]
        nucleus = (m["masses"], m["coarse"], m["above"], m["total"])
        above, totals, least = ints(T, dtype=torch.int64), m["total"], m["least"]
        cut_top = m["cut_top"]
    else:
        tops, high, parts = ints(T), maxima, 1  # no table is read without top-p alone
        filter_bound_kernel[(T,)](
            maxima, tops, bound, n, top_k if has_k else 0,
            HAS_K=has_k, BN=block_of(n), num_warps=8, **EXACT,
        )
        above, totals, least = (ints(T, dtype=torch.int64) for _ in range(3))
        nucleus = (above, bound, above, above)  # not read without top-p alone
        cut_top = bound  # neither
    bucket = ints(T)
    filter_hist_kernel[(T, chunks)](
        bits16, bound, high, hist, *nucleus, bucket, above, cut_top, top_p, V, parts,
        COARSE=coarse, BV=CHUNK, BC=block_of(parts), num_warps=4, **EXACT,
    )
    filter_scan_kernel[(T,)](
        hist, tops, above, totals, least, cut_top, floor, floor_id, cut_bin, cut_rank,
        inv_temperature, top_k if has_k else 0, top_p, log_min_p, V,
        HAS_K=has_k, HAS_P=has_p, HAS_MIN_P=has_min_p, COARSE=coarse,
        IS_BF16=is_bf16, BB=SCAN_BLOCK, num_warps=8, **EXACT,
    )
    filter_ties_count_kernel[(T, chunks)](
        bits16, cut_bin, cut_rank, counts, V, chunks, BV=CHUNK, num_warps=4, **EXACT
    )
    filter_ties_pick_kernel[(T, chunks)](
        bits16, cut_bin, cut_rank, counts, floor_id, V, chunks,
        BV=CHUNK, BC=block_of(chunks), num_warps=4, **EXACT,
    )
    return floor, floor_id
