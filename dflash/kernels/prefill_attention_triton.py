"""Triton kernel: causal prefill attention, a flash-attention forward over the KV cache.

One program per (query tile, batch x KV head). The ``G * T`` query rows of one KV head
(``G = H // HKV`` query heads per KV head) are laid out as row ``r = t * G + g`` (query
head ``kv * G + g`` at position ``start + t``), so a tile holds whole positions' worth of
heads and every key/value tile it loads serves the ``G`` query heads that read it; the
cache is never expanded per query head. The tile walks the keys ``0 .. start + t_last``
(``t_last`` its last position) in ``BLOCK_N`` blocks with an online softmax in float32:

- blocks that end at or before key ``start + t_first`` (``t_first`` the tile's first
  position) are visible to every row of the tile and run without a mask;
- the remaining (diagonal) blocks mask key ``n`` for the row at position ``p`` when
  ``n > p``, and load no key at or past ``start + t_last + 1``.

So keys at or past ``start + T`` (unwritten rows, possibly NaN) are never loaded, and no
``T x S`` or ``T x T`` tensor exists: a program's scratch is its query tile, one key and
value tile per pipeline stage, the ``[BLOCK_M, BLOCK_N]`` scores and the
``[BLOCK_M, D]`` float32 accumulator. Products go through ``tl.dot`` (float32 inputs in
IEEE precision, no TF32); the probabilities are rounded to the value dtype for the second
product, as is usual for half-precision flash attention. Every program writes its own
output rows once, with no atomics: the result is deterministic. A head dim that is not a
power of two is padded to the next one (at least 16) with masked loads and stores.

Tiles are launched last rows first: under causal masking a tile's work grows with its
position, and starting the longest tiles first shortens the tail of the grid.

``start`` and ``T`` are never specialised (``do_not_specialize``): every chunk position
runs one binary. ``BLOCK_M`` (a constexpr) shrinks for short chunks
(:func:`prefill_config`), so a ``T = 1`` call does not pay for 64 query rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from dflash.kernels.checks import INTERPRET

#: the score of a masked key (a constexpr: Triton kernels read only constexpr globals)
NEG_INF = tl.constexpr(float("-inf"))
LOG2E = 1.4426950408889634
#: the smallest tile side ``tl.dot`` takes
MIN_BLOCK = 16


@dataclass(frozen=True)
class PrefillConfig:
    """Tile sizes and Triton launch options of one call."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


def prefill_config(D: int, rows: int, itemsize: int) -> PrefillConfig:
    """Tiles for head dim ``D`` (at most 256), ``rows = G * T`` query rows per KV head and
    ``itemsize``-byte elements, sized for an H100/H200-class GPU (228 KB of shared memory
    and 64K 32-bit registers per SM, at most 255 per thread).

    Half precision (the products run on the tensor cores):

    - ``D <= 64``: 128 query rows x 64 keys, 4 warps, 3 stages: the float32 accumulator
      (128 x 64) is 64 registers per thread, three stages of K and V tiles 48 KB.
    - ``D <= 128``: 64 x 64, 4 warps, 3 stages. A 128-row tile would double the
      accumulator to 128 registers per thread; 64 rows also give twice the programs,
      which balances the causal grid better. K and V stages: 96 KB, two programs per SM.
    - ``D <= 256``: 128 x 64, 8 warps, 2 stages: the 128 x 256 accumulator is spread over
      8 warps; the query tile (64 KB) and two stages of 64-key K and V tiles (128 KB) fit
      the shared memory. Timed on the H200 at the 9B attention (4,096-row chunks at 32k
      and 128k keys, ``benchmarks/hot_kernels.py --part prefill``): 441-451 TFLOPS, the
      best of 16 configurations, against 146-150 for the 64 x 32, 8-warp, 2-stage tile it
      replaced (128 x 32 with 3 stages: 426-432, the old tile's bits).

    float32 (IEEE products on the FMA units: both operands of a product are held in
    registers, so the tiles are smaller): 64 x 32 for ``D <= 64``, 32 x 32 for
    ``D <= 128``, 32 x 16 for ``D <= 256``, all 8 warps and 2 stages.

    Every configuration fits the shared memory and compiles for sm_90 without register
    spills (or a few bytes of them). Short chunks shrink the query tile to the next power
    of two of ``rows`` (at least 16): at ``T = 1`` a 64-row tile would be mostly padding.
    """
    if itemsize >= 4:
        block_m, block_n = (64, 32) if D <= 64 else (32, 32) if D <= 128 else (32, 16)
        num_warps, num_stages = 8, 2
    elif D <= 64:
        block_m, block_n, num_warps, num_stages = 128, 64, 4, 3
    elif D <= 128:
        block_m, block_n, num_warps, num_stages = 64, 64, 4, 3
    else:
        block_m, block_n, num_warps, num_stages = 128, 64, 8, 2
    block_m = max(MIN_BLOCK, min(block_m, triton.next_power_of_2(rows)))
    return PrefillConfig(block_m, block_n, num_warps, num_stages)


@triton.jit  # type: ignore[untyped-decorator]  # triton ships no types
def dot(a, b, acc, F32: tl.constexpr, INTERPRET: tl.constexpr):  # type: ignore[no-untyped-def]  # Triton values are untyped
    """``acc + a @ b`` with float32 accumulation. ``F32``: float32 operands, IEEE products
    (no TF32). The interpreter multiplies bfloat16 operands wrongly (numpy has no
    bfloat16), so there the operands enter as float32: the products of the same rounded
    values, exact in float32 as the tensor cores' are."""
    if INTERPRET or F32:
        r = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        r = tl.dot(a, b, acc)
    return r


@triton.jit  # type: ignore[untyped-decorator]  # triton ships no types
def attend_block(  # type: ignore[no-untyped-def]  # Triton values are untyped
    b_q, p_k0, p_v0, s_ks, s_vs, n0, n_end, pos, m_d, b_m, b_l, b_o, qk_scale,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
    EVEN_D: tl.constexpr, F32_DOT: tl.constexpr, INTERPRET: tl.constexpr,
):
    """The online-softmax step over keys ``n0 .. n0 + BLOCK_N - 1``; returns the updated
    running max ``b_m``, sum ``b_l`` and unnormalised output ``b_o`` of the tile's rows.

    ``MASKED`` (a diagonal block): keys at or past ``n_end`` are not loaded and key ``n``
    is hidden from the row at position ``pos`` when ``n > pos``. Otherwise every key of
    the block is visible to every row (and below ``n_end``). ``EVEN_D``: the head dim
    fills the tile, no column mask.
    """
    o_n = (n0 + tl.arange(0, BLOCK_N)).to(tl.int64)
    p_k = p_k0 + o_n[:, None] * s_ks
    p_v = p_v0 + o_n[:, None] * s_vs
    if MASKED:
        m_kv = (o_n < n_end)[:, None] & m_d[None, :]
        b_k = tl.load(p_k, mask=m_kv, other=0)           # [BLOCK_N, BD]
        b_v = tl.load(p_v, mask=m_kv, other=0)
    elif EVEN_D:
        b_k = tl.load(p_k)
        b_v = tl.load(p_v)
    else:
        b_k = tl.load(p_k, mask=m_d[None, :], other=0)
        b_v = tl.load(p_v, mask=m_d[None, :], other=0)
    b_s = dot(b_q, tl.trans(b_k), tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32),
              F32_DOT, INTERPRET)                        # [BLOCK_M, BLOCK_N]
    b_s = b_s * qk_scale                                 # log2 units: exp2 below
    if MASKED:
        b_s = tl.where(o_n[None, :] <= pos[:, None], b_s, NEG_INF)
    # every row sees key 0 in the first block it walks, so b_m_new is finite here and
    # the first rescale is exp2(-inf) = 0
    b_m_new = tl.maximum(b_m, tl.max(b_s, 1))
    b_alpha = tl.math.exp2(b_m - b_m_new)
    b_p = tl.math.exp2(b_s - b_m_new[:, None])
    b_l = b_l * b_alpha + tl.sum(b_p, 1)
    b_o = b_o * b_alpha[:, None]
    b_o = dot(b_p.to(b_v.dtype), b_v, b_o, F32_DOT, INTERPRET)
    return b_m_new, b_l, b_o


@triton.jit  # type: ignore[untyped-decorator]  # triton ships no types
def attend_range(  # type: ignore[no-untyped-def]  # Triton values are untyped
    b_q, p_k0, p_v0, s_ks, s_vs, n_lo, n_hi, n_end, pos, m_d, b_m, b_l, b_o, qk_scale,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
    EVEN_D: tl.constexpr, F32_DOT: tl.constexpr, INTERPRET: tl.constexpr,
):
    """:func:`attend_block` over the blocks starting at ``n_lo, n_lo + BLOCK_N, ..`` below
    ``n_hi``. On the GPU a ``for`` loop, which Triton software-pipelines (``num_stages``);
    the interpreter cannot ``range()`` over a runtime bound, so there a ``while`` loop
    walks the same blocks in the same order."""
    if INTERPRET:
        n0 = n_lo
        while n0 < n_hi:
            b_m, b_l, b_o = attend_block(
                b_q, p_k0, p_v0, s_ks, s_vs, n0, n_end, pos, m_d, b_m, b_l, b_o,
                qk_scale, BLOCK_M, BLOCK_N, MASKED, EVEN_D, F32_DOT, INTERPRET)
            n0 += BLOCK_N
    else:
        for n0 in range(n_lo, n_hi, BLOCK_N):
            b_m, b_l, b_o = attend_block(
                b_q, p_k0, p_v0, s_ks, s_vs, n0, n_end, pos, m_d, b_m, b_l, b_o,
                qk_scale, BLOCK_M, BLOCK_N, MASKED, EVEN_D, F32_DOT, INTERPRET)
    return b_m, b_l, b_o


@triton.jit(do_not_specialize=["start", "T"])  # type: ignore[untyped-decorator]  # triton ships no types
def prefill_attention_kernel(  # type: ignore[no-untyped-def]  # Triton pointers are untyped
    q, k, v, y,                              # q, y [B, T, H, D]; k, v [B, HKV, S_max, D]
    qk_scale,                                # softmax scale * log2(e)
    start, T,
    s_qb, s_qt, s_qh, s_kb, s_kh, s_ks, s_vb, s_vh, s_vs, s_yb, s_yt, s_yh,
    HKV: tl.constexpr, G: tl.constexpr, D: tl.constexpr, BD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, EVEN_D: tl.constexpr,
    F32_DOT: tl.constexpr, INTERPRET: tl.constexpr,
):
    # the last query tile (the most keys) first
    i_m = (tl.num_programs(0) - 1 - tl.program_id(0)).to(tl.int64)
    i_bh = tl.program_id(1).to(tl.int64)
    i_b, i_hk = i_bh // HKV, i_bh % HKV

    o_r = i_m * BLOCK_M + tl.arange(0, BLOCK_M)        # row r = t * G + g of this KV head
    m_r = o_r < G * T
    o_t = o_r // G
    o_h = i_hk * G + o_r % G
    pos = start + o_t                                  # absolute position of each row
    # the tile's first and last position, reduced from its rows
    t_first = tl.min(tl.where(m_r, o_t, T), 0)
    t_last = tl.max(tl.where(m_r, o_t, -1), 0)
    n_end = start + t_last + 1                         # no row sees a key at or past this
    # keys below n_full are visible to every row (all sit at start + t_first or later)
    n_full = ((start + t_first + 1) // BLOCK_N) * BLOCK_N

    o_d = tl.arange(0, BD)
    m_d = o_d < D
    p_q = q + i_b * s_qb + o_t[:, None] * s_qt + o_h[:, None] * s_qh + o_d[None, :]
    b_q = tl.load(p_q, mask=m_r[:, None] & m_d[None, :], other=0)   # [BLOCK_M, BD]
    b_m = tl.full([BLOCK_M], NEG_INF, dtype=tl.float32)
    b_l = tl.zeros([BLOCK_M], dtype=tl.float32)
    b_o = tl.zeros([BLOCK_M, BD], dtype=tl.float32)
    p_k0 = k + i_b * s_kb + i_hk * s_kh + o_d[None, :]
    p_v0 = v + i_b * s_vb + i_hk * s_vh + o_d[None, :]
    b_m, b_l, b_o = attend_range(
        b_q, p_k0, p_v0, s_ks, s_vs, 0, n_full, n_end, pos, m_d, b_m, b_l, b_o, qk_scale,
        BLOCK_M, BLOCK_N, False, EVEN_D, F32_DOT, INTERPRET)
    b_m, b_l, b_o = attend_range(
        b_q, p_k0, p_v0, s_ks, s_vs, n_full, n_end, n_end, pos, m_d, b_m, b_l, b_o,
        qk_scale, BLOCK_M, BLOCK_N, True, EVEN_D, F32_DOT, INTERPRET)

    b_y = b_o / b_l[:, None]
    p_y = y + i_b * s_yb + o_t[:, None] * s_yt + o_h[:, None] * s_yh + o_d[None, :]
    tl.store(p_y, b_y.to(y.dtype.element_ty), mask=m_r[:, None] & m_d[None, :])


def launch_prefill_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, start: int,
    scale: float, out: torch.Tensor | None, *, config: PrefillConfig | None = None,
) -> torch.Tensor:
    """Launch the kernel on validated inputs; returns ``out`` (``[B, T, H, D]``).

    ``config`` overrides :func:`prefill_config` (tests of the tile and block boundaries
    at small sizes, benchmark sweeps); its blocks must be powers of two >= 16.
    """
    B, T, H, D = q.shape
    HKV = k_cache.shape[1]
    G = H // HKV
    if config is None:
        config = prefill_config(D, G * T, q.element_size())
    for name, size in (("block_m", config.block_m), ("block_n", config.block_n)):
        if size < MIN_BLOCK or size & (size - 1):
            raise ValueError(f"'config.{name}' must be a power of two >= 16 (got {size})")
    if out is None:
        out = torch.empty(B, T, H, D, dtype=q.dtype, device=q.device)
    BD = max(MIN_BLOCK, triton.next_power_of_2(D))
    grid = (triton.cdiv(G * T, config.block_m), B * HKV)
    prefill_attention_kernel[grid](
        q, k_cache, v_cache, out, scale * LOG2E, start, T,
        q.stride(0), q.stride(1), q.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        HKV=HKV, G=G, D=D, BD=BD, BLOCK_M=config.block_m, BLOCK_N=config.block_n,
        EVEN_D=BD == D, F32_DOT=q.dtype == torch.float32, INTERPRET=INTERPRET,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return out
