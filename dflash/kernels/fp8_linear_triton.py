"""Triton kernel: skinny GEMM ``y = x @ dequant(w).T + b`` on a block-scaled float8
weight, whose rows do not depend on M.

The weight stays in HBM as float8 e4m3 (one byte per element, half the bytes of bf16:
decode is a stream over the weights, so the bytes are the time) with one float32 scale
per ``bn × bk`` block. The layout and the row invariance are those of
:mod:`dflash.kernels.linear_triton`, whose row-tile product (:func:`mma`), store
(:func:`row_tile_store`) and split-K reductions (the pass :func:`linear_reduce_kernel`;
with ``DFLASH_SPLIT_FIXUP=1``, :func:`last_split_reduces` inside the kernel up to two row
tiles) this kernel shares:

- rows travel in FIXED 16-row tiles (masked), up to ``M_TILES`` tiles per program (the
  next power of two of ``cdiv(M, 16)``, at most 8); each K step loads the weight tile
  ONCE and multiplies it with every row tile of the program in turn, each into the
  tile's own float32 accumulator. An output element depends on its own row of x, the
  weight and the scales only — never on the other rows nor on M;
- K is walked one SCALE block at a time, ascending: the K tile ``BLOCK_K`` is the scale
  block ``bk`` rounded up to a power of two (lanes past ``bk`` are masked), so every
  K step covers exactly one column of scales;
- ``BLOCK_N`` and the split-K count come from :func:`fp8_linear_config`
  ``(N, K, dtype, block)``, never from M; with split-K each split walks a fixed run of
  whole K blocks and writes float32 partial sums to a workspace, and a second pass (or
  the last split to finish) adds the splits in ascending order (then the bias) and rounds
  once — no value added by an atomic.

Scale application (one K block ``j``, output element ``(m, n)``)::

    p   = sum_{k in block j} float(w[n, k]) * x[m, k]     # float32, fresh accumulator
    acc = fma(p, scale_inv[n // bn, j], acc)               # float32, one rounding

The e4m3 weights are converted to x's dtype before the product: every e4m3 value is
exact in float16, bfloat16 and float32, so the conversion rounds nothing, and the 16-bit
product runs on the tensor cores with float32 accumulation (float32 x: full-precision
products, no TF32). Scaling the block's float32 partial sum, rather than the weight
tile, keeps every weight exact: a scaled weight would have to be rounded to bf16 (or
f16) again before a 16-bit product; here one float32 multiply per block and output
element is all the scaling costs in precision.
:func:`dflash.kernels.fp8_linear_reference` performs the same operations in the same
order; the sums inside a block (an MMA here, a matrix-vector product there) and, with
split-K, the grouping of the block sums differ, so the two agree closely, not bitwise.

Two forms of the same arithmetic (:class:`Fp8LinearConfig`): the product ``w_tile @
x_tile.T`` (the default) or ``x_tile @ w_tile.T`` (``x_major``), and the e4m3 values by
``.to`` or by integer operations and a bf16x2 multiply (``bit_convert``, bfloat16 x). Each
form keeps the row tiles, K steps and split order, so each is M-invariant on its own.

``M`` is a runtime argument that Triton never specialises (``do_not_specialize``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from dflash.kernels.checks import INTERPRET
from dflash.kernels.linear_triton import (
    BLOCK_M,
    BLOCK_REDUCE,
    MAX_M_TILES,
    MIN_K_BLOCKS,
    MIN_STAGES,
    STAGE_BYTES,
    TARGET_PROGRAMS,
    last_split_reduces,
    linear_reduce_kernel,
    m_tiles_for,
    mma,
    row_tile_store,
    split_counters,
)

#: the widest scale block along K the kernel walks in one step (one K tile per block)
MAX_BLOCK_K = 128
#: scale blocks along K must be a multiple of this (the smallest MMA depth)
MIN_BLOCK_K = 16
#: the N tile: 128 weight rows, a whole scale block of the checkpoints' 128 × 128 blocks.
#: Measured on the H200 (``benchmarks/hot_kernels.py --part fp8``, bf16 x, M = 1), the
#: sweep's best at both 9B shapes it reached was a 128-row tile with 2 × 264 programs:
#: 12288 × 4096 19.2 µs (split 4) against 25.7 with 64 rows and 192 programs (split 1);
#: 4096 × 4096 8.6 µs (split 8) against 8.8 (64 rows, split 4)
BLOCK_N = 128
#: split-K doubles while the doubled grid stays within this many programs (4 per SM of
#: the H200's 132); bf16's :data:`TARGET_PROGRAMS` is half: the FP8 tile streams half the
#: bytes per element, so more programs are in flight to cover the same latency
FP8_TARGET_PROGRAMS = 2 * TARGET_PROGRAMS


@dataclass(frozen=True)
class Fp8LinearConfig:
    """One launch configuration: the N tile, the K tile (the scale block ``bk`` padded
    to a power of two), the split-K count and Triton launch options."""

    block_n: int
    block_k: int
    split_k: int
    num_warps: int
    num_stages: int
    #: the product as ``x_tile @ w_tile.T``, the weight the MMA's second operand: for sm_90
    #: (triton 3.6) the e4m3 tile then reaches the registers in 8-byte shared loads, where
    #: the default ``w_tile @ x_tile.T`` (the weight the first operand, converted in the
    #: MMA's register layout) takes 2-byte ones. The same row tiles, K steps, scales and
    #: split order: rows stay independent of M. On by default (:data:`FORM`): measured on
    #: the H200 it is the faster form at every 9B shape
    x_major: bool = True
    #: bfloat16 x: each e4m3 byte widened to bfloat16 by integer operations and one bf16x2
    #: multiply by 2^120 (:data:`E4M3_TO_BF16`) instead of the three conversion
    #: instructions per pair that ``.to`` emits (``cvt.rn.f16x2.e4m3x2``, then
    #: ``cvt.bf16.f16`` twice): the same value for every finite byte. A NaN byte becomes
    #: ±480, not NaN: checkpoints holding one are refused at load and the quantizer never
    #: writes one, but a direct caller's weight is not scanned. Compiled kernels only; the
    #: interpreter uses ``.to``. On by default (:data:`FORM`), as ``x_major``
    bit_convert: bool = True


def form_from_env() -> tuple[bool, bool]:
    """``(x_major, bit_convert)`` of the default configuration, from ``DFLASH_FP8_FORM``:
    unset or empty, the default (both on: the faster form on the H200, 9B plain greedy
    162.8 → 183.1 tok/s); ``none`` (both off: the weight as the MMA's first operand,
    converted by ``.to``), ``x_major``, ``bits`` or ``x_major,bits``; another value is a
    ``ValueError`` naming it. Each form is M-invariant on its own, so a whole run (a
    benchmark, decoding and its parity check) may take one."""
    raw = os.environ.get("DFLASH_FP8_FORM", "")
    if raw in ("", "x_major,bits", "bits,x_major"):
        return True, True
    if raw == "none":
        return False, False
    if raw in ("x_major", "bits"):
        return raw == "x_major", raw == "bits"
    raise ValueError(
        "DFLASH_FP8_FORM must be empty (the default: x_major,bits), 'none', 'x_major', "
        f"'bits' or 'x_major,bits' (got {raw!r})"
    )


#: the default configuration's form, read once at import (:func:`form_from_env`)
FORM = form_from_env()


@dataclass(frozen=True)
class Fp8LinearLaunch:
    """What :func:`launch_fp8_linear` launches for one call: the configuration, the row
    tiles per program, the K blocks a split walks, the split count actually launched (at
    most ``config.split_k``: no split is left empty) and the grid ``(row groups, N tiles,
    splits)``."""

    config: Fp8LinearConfig
    m_tiles: int
    k_blocks_per_split: int
    split: int
    grid: tuple[int, int, int]
    #: no load needs a mask but the rows': N a multiple of the N tile, K of the scale
    #: block ``bk`` (itself a power of two, the K tile) and the splits end at the last block
    even: bool = False


def fp8_linear_config(
    N: int, K: int, dtype: torch.dtype, block: tuple[int, int] = (128, 128), m_tiles: int = 1
) -> Fp8LinearConfig:
    """The configuration for an ``[N, K]`` float8 weight with scale blocks ``block``, x of
    ``dtype`` and ``m_tiles`` row tiles per program.

    Tiles and the split-K count depend on ``N``, ``K``, ``block`` only (they fix the
    reduction order); ``dtype`` and ``m_tiles`` set the pipeline depth alone.

    - ``BLOCK_K``: the scale block ``bk`` rounded up to a power of two (128 for the
      checkpoints' 128 × 128 blocks: 128-byte weight rows per load);
    - ``BLOCK_N = 128`` (:data:`BLOCK_N`), smaller only for ``N < 128``;
    - split-K as :func:`dflash.kernels.linear_triton.linear_config` with twice its
      programs: it doubles while the doubled grid of one row group stays within
      :data:`FP8_TARGET_PROGRAMS` (528) programs and each split keeps at least
      ``MIN_K_BLOCKS`` (4) K blocks. At the 9B shapes with 128 × 128 blocks: split 8 for
      4096 × 4096 (256 programs), 16 for 4096 × 12288 (512), 4 for 12288 × 4096 (384),
      1 for the LM head (1,940 N tiles);
    - 4 warps; pipeline stages 4 (3 for float32 x), fewer when a stage (one float8
      weight tile plus ``m_tiles`` row tiles) would push the pipeline past
      ``STAGE_BYTES``, never fewer than ``MIN_STAGES``. bf16, 128 × 128 blocks: a stage
      is 20, 24, 32, 48 KB for 1, 2, 4, 8 tiles, so 4, 4, 3, 2 stages.
    """
    if m_tiles < 1 or m_tiles > MAX_M_TILES or m_tiles & (m_tiles - 1):
        raise ValueError(
            f"'m_tiles' must be a power of two in 1 … {MAX_M_TILES} (got {m_tiles})"
        )
    bn, bk = block
    if bn < 1 or bk % MIN_BLOCK_K or not MIN_BLOCK_K <= bk <= MAX_BLOCK_K:
        raise ValueError(
            f"'block' must be (bn >= 1, bk a multiple of {MIN_BLOCK_K} in "
            f"{MIN_BLOCK_K} … {MAX_BLOCK_K}) for Triton (got {block})"
        )
    block_k = int(triton.next_power_of_2(bk))
    block_n = BLOCK_N if N >= BLOCK_N else max(16, int(triton.next_power_of_2(N)))
    n_tiles = triton.cdiv(N, block_n)
    k_blocks = triton.cdiv(K, bk)
    split = 1
    while n_tiles * 2 * split <= FP8_TARGET_PROGRAMS and k_blocks // (2 * split) >= MIN_K_BLOCKS:
        split *= 2
    stage = block_n * block_k + m_tiles * BLOCK_M * block_k * dtype.itemsize
    stages = max(MIN_STAGES, min(3 if dtype == torch.float32 else 4, STAGE_BYTES // stage))
    return Fp8LinearConfig(block_n, block_k, split, num_warps=4, num_stages=stages,
                           x_major=FORM[0], bit_convert=FORM[1])


def fp8_linear_launch(
    M: int, N: int, K: int, dtype: torch.dtype, block: tuple[int, int] = (128, 128),
    config: Fp8LinearConfig | None = None,
) -> Fp8LinearLaunch:
    """The launch of an ``M``-row call on an ``[N, K]`` float8 weight.

    ``config`` overrides :func:`fp8_linear_config` (tests and benchmark sweeps only:
    another config is another reduction order); its ``block_k`` must then be ``bk``
    padded to a power of two. The grid has ``cdiv(N, block_n) * split`` programs per row
    group and one row group up to 128 rows, so the weight is read once per call.
    """
    tiles = m_tiles_for(M)
    cfg = config or fp8_linear_config(N, K, dtype, block, tiles)
    if cfg.block_k != triton.next_power_of_2(block[1]):
        raise ValueError(
            f"'config' block_k must be bk={block[1]} padded to a power of two "
            f"(got {cfg.block_k})"
        )
    k_blocks = triton.cdiv(K, block[1])
    per_split = triton.cdiv(k_blocks, cfg.split_k)
    split = triton.cdiv(k_blocks, per_split)   # never an empty split
    groups = triton.cdiv(triton.cdiv(M, BLOCK_M), tiles)
    grid = (groups, triton.cdiv(N, cfg.block_n), split)
    even = (N % cfg.block_n == 0 and block[1] == cfg.block_k and K % block[1] == 0
            and k_blocks % per_split == 0)
    return Fp8LinearLaunch(cfg, tiles, per_split, split, grid, even)


@triton.jit  # type: ignore[untyped-decorator]  # triton ships no types
def row_tile_scaled_dot(  # type: ignore[no-untyped-def]  # Triton values are untyped
    b_acc, b_w, b_s, x, o_k, m_k, i_t, M, s_xm,
    BLOCK_M: tl.constexpr, F32_DOT: tl.constexpr, EMULATE: tl.constexpr,
    EVEN: tl.constexpr,
):
    """``b_acc + (b_w @ x[rows of tile i_t, o_k].T) * b_s[:, None]``: one row tile's K
    block, its product summed from zero in float32, then scaled (rows past M load
    zeros). ``b_acc [BLOCK_N, BLOCK_M]`` is the tile's output, transposed; ``b_s
    [BLOCK_N]`` the block's scale of each output row."""
    o_m = i_t * BLOCK_M + tl.arange(0, BLOCK_M)
    p_x = x + o_m[None, :] * s_xm + o_k[:, None]
    if EVEN:   # every column of the block lies inside K: rows past M are the only mask
        b_x = tl.load(p_x, mask=(o_m < M)[None, :], other=0)
    else:
        b_x = tl.load(p_x, mask=m_k[:, None] & (o_m < M)[None, :], other=0)   # [BLOCK_K, BLOCK_M]
    b_p = mma(b_w, b_x, tl.zeros_like(b_acc), F32_DOT, EMULATE)
    # one explicit fused multiply-add: a multiply then an add may be contracted into an
    # fma or not at the compiler's choice; spelled out, every variant rounds alike
    return tl.fma(b_p, b_s[:, None], b_acc)


#: PTX for four e4m3 bytes (one 32-bit register, byte ``i`` element ``i``) to four
#: bfloat16 (two registers, element 0 in the low half): one ``prmt`` moves two bytes into
#: the high bytes of two 16-bit lanes (``s eeee mmm 0000 0000``: the sign already where a
#: bfloat16 has it), one shift right by 4 and one mask put ``eeee mmm`` under it
#: (``s 0000 eeee mmm 0000``, one ``lop3`` with the sign: a bfloat16 of the same sign,
#: exponent field ``eeee`` and mantissa ``mmm``, the byte's value times 2^-120, a bfloat16
#: subnormal for a subnormal byte), then a bf16x2 multiply by 2^120 (``0x7B80``): exact,
#: the product is the byte's value, which bfloat16 holds. Five instructions per two
#: elements. A NaN byte (``x 1111 111``) would give ±480, so NaN bytes are refused at load
#: (``dflash.model.loading``: every tensor must be finite).
E4M3_TO_BF16 = tl.constexpr("""
{
.reg .b32 lo, hi, t0, t1, c;
mov.b32 c, 0x7B807B80;
prmt.b32 lo, $2, 0, 0x1404;
prmt.b32 hi, $2, 0, 0x3424;
shr.b32 t0, lo, 4;
shr.b32 t1, hi, 4;
and.b32 t0, t0, 0x07F007F0;
and.b32 t1, t1, 0x07F007F0;
and.b32 lo, lo, 0x80008000;
and.b32 hi, hi, 0x80008000;
or.b32 lo, lo, t0;
or.b32 hi, hi, t1;
mul.rn.bf16x2 $0, lo, c;
mul.rn.bf16x2 $1, hi, c;
}
""")


@triton.jit  # type: ignore[untyped-decorator]  # triton ships no types
def e4m3_values(  # type: ignore[no-untyped-def]  # Triton values are untyped
    b_w, DTYPE: tl.constexpr, BITS: tl.constexpr,
):
    """An e4m3 tile in ``DTYPE`` (exact: e4m3 fits float16, bfloat16 and float32):
    ``BITS`` by :data:`E4M3_TO_BF16` (bfloat16 only, compiled kernels only), else
    ``.to``."""
    if BITS:
        v = tl.inline_asm_elementwise(E4M3_TO_BF16, "=r,=r,r", [b_w.to(tl.uint8, bitcast=True)],
                                      dtype=tl.bfloat16, is_pure=True, pack=4)
    else:
        v = b_w.to(DTYPE)
    return v


@triton.jit  # type: ignore[untyped-decorator]  # triton ships no types
def x_major_scaled_dot(  # type: ignore[no-untyped-def]  # Triton values are untyped
    b_acc, b_w, b_s, x, o_k, m_k, i_t, M, s_xm,
    BLOCK_M: tl.constexpr, F32_DOT: tl.constexpr, EMULATE: tl.constexpr,
    EVEN: tl.constexpr,
):
    """:func:`row_tile_scaled_dot` with the product the other way round: ``b_acc +
    (x[rows of tile i_t, o_k] @ b_w.T) * b_s[None, :]``, ``b_acc [BLOCK_M, BLOCK_N]`` the
    tile's output as it is stored (not transposed)."""
    o_m = i_t * BLOCK_M + tl.arange(0, BLOCK_M)
    p_x = x + o_m[:, None] * s_xm + o_k[None, :]
    if EVEN:   # every column of the block lies inside K: rows past M are the only mask
        b_x = tl.load(p_x, mask=(o_m < M)[:, None], other=0)
    else:
        b_x = tl.load(p_x, mask=(o_m < M)[:, None] & m_k[None, :], other=0)   # [BLOCK_M, BLOCK_K]
    b_p = mma(b_x, tl.trans(b_w), tl.zeros_like(b_acc), F32_DOT, EMULATE)
    return tl.fma(b_p, b_s[None, :], b_acc)


@triton.jit  # type: ignore[untyped-decorator]  # triton ships no types
def tile_zeros(  # type: ignore[no-untyped-def]  # Triton values are untyped
    BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, X_MAJOR: tl.constexpr,
):
    """A row tile's float32 accumulator: ``[BLOCK_M, BLOCK_N]`` x-major, else transposed."""
    if X_MAJOR:
        z = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    else:
        z = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    return z


@triton.jit  # type: ignore[untyped-decorator]  # triton ships no types
def tile_step(  # type: ignore[no-untyped-def]  # Triton values are untyped
    b_acc, b_w, b_s, x, o_k, m_k, i_t, M, s_xm,
    BLOCK_M: tl.constexpr, F32_DOT: tl.constexpr, EMULATE: tl.constexpr,
    X_MAJOR: tl.constexpr, EVEN: tl.constexpr,
):
    """One row tile's K block in the kernel's product form."""
    if X_MAJOR:
        r = x_major_scaled_dot(b_acc, b_w, b_s, x, o_k, m_k, i_t, M, s_xm,
                               BLOCK_M, F32_DOT, EMULATE, EVEN)
    else:
        r = row_tile_scaled_dot(b_acc, b_w, b_s, x, o_k, m_k, i_t, M, s_xm,
                                BLOCK_M, F32_DOT, EMULATE, EVEN)
    return r


@triton.jit  # type: ignore[untyped-decorator]  # triton ships no types
def tile_out(b_acc, X_MAJOR: tl.constexpr):  # type: ignore[no-untyped-def]  # untyped values
    """A row tile's accumulator as :func:`row_tile_store` takes it, ``[BLOCK_N, BLOCK_M]``."""
    if X_MAJOR:  # noqa: SIM108  # a compile-time branch: each form compiles one arm
        r = tl.trans(b_acc)
    else:
        r = b_acc
    return r


@triton.jit(do_not_specialize=["M"])  # type: ignore[untyped-decorator]  # triton ships no types
def fp8_linear_kernel(  # type: ignore[no-untyped-def]  # Triton pointers are untyped
    x, w, s, b, y, ws,       # x [M, K] (s_xm), w [N, K] e4m3 (s_wn), s [NB, KB] f32, b [N]
    counters,                # int32 arrival counters (FIXUP), zero between launches
    M, N, K, s_xm, s_wn, s_sn, s_sk, s_ym,   # y [M, N] (s_ym); ws [SPLIT_K, M, N] float32
    BN: tl.constexpr, BK: tl.constexpr, K_BLOCKS: tl.constexpr,
    K_BLOCKS_PER_SPLIT: tl.constexpr, SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_M: tl.constexpr,
    M_TILES: tl.constexpr, F32_DOT: tl.constexpr, EMULATE: tl.constexpr,
    X_MAJOR: tl.constexpr, BITS: tl.constexpr, EVEN: tl.constexpr, FIXUP: tl.constexpr,
):
    i_g = tl.program_id(0).to(tl.int64)   # row group: tiles i_g * M_TILES + 0 … M_TILES - 1
    i_n = tl.program_id(1).to(tl.int64)
    i_s = tl.program_id(2).to(tl.int64)
    t0 = i_g * M_TILES
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_n = o_n < N
    p_s = s + (o_n // BN) * s_sn          # each output row's row of scales
    o_kk = tl.arange(0, BLOCK_K)
    kb0 = i_s * K_BLOCKS_PER_SPLIT

    # one accumulator per row tile, unrolled as in linear_kernel
    b_acc0 = tile_zeros(BLOCK_N, BLOCK_M, X_MAJOR)
    if M_TILES > 1:
        b_acc1 = tile_zeros(BLOCK_N, BLOCK_M, X_MAJOR)
    if M_TILES > 2:
        b_acc2 = tile_zeros(BLOCK_N, BLOCK_M, X_MAJOR)
        b_acc3 = tile_zeros(BLOCK_N, BLOCK_M, X_MAJOR)
    if M_TILES > 4:
        b_acc4 = tile_zeros(BLOCK_N, BLOCK_M, X_MAJOR)
        b_acc5 = tile_zeros(BLOCK_N, BLOCK_M, X_MAJOR)
        b_acc6 = tile_zeros(BLOCK_N, BLOCK_M, X_MAJOR)
        b_acc7 = tile_zeros(BLOCK_N, BLOCK_M, X_MAJOR)
    # one scale block per step, ascending; the last split may run past the last block
    # (every load masked: it adds zeros)
    for j in range(0, K_BLOCKS_PER_SPLIT):
        kb = kb0 + j
        o_k = kb * BK + o_kk
        m_k = (o_kk < BK) & (o_k < K)
        p_w = w + o_n[:, None] * s_wn + o_k[None, :]
        if EVEN:   # whole tiles, whole blocks, no split past the last block: no masks
            b_w = tl.load(p_w)
            b_s = tl.load(p_s + kb * s_sk)
        else:
            # [BLOCK_N, BLOCK_K] e4m3; ``other`` a float zero (Triton casts no int to float8)
            b_w = tl.load(p_w, mask=m_n[:, None] & m_k[None, :], other=0.0)
            # the block bound as a [BLOCK_N] comparison: a scalar and-ed into the mask makes
            # a mask of another dtype under some interpreters
            m_s = m_n & ((o_n * 0 + kb) < K_BLOCKS)
            b_s = tl.load(p_s + kb * s_sk, mask=m_s, other=0)   # [BLOCK_N]
        b_w = e4m3_values(b_w, x.dtype.element_ty, BITS)
        b_acc0 = tile_step(b_acc0, b_w, b_s, x, o_k, m_k, t0, M, s_xm,
                           BLOCK_M, F32_DOT, EMULATE, X_MAJOR, EVEN)
        if M_TILES > 1:
            b_acc1 = tile_step(b_acc1, b_w, b_s, x, o_k, m_k, t0 + 1, M, s_xm,
                               BLOCK_M, F32_DOT, EMULATE, X_MAJOR, EVEN)
        if M_TILES > 2:
            b_acc2 = tile_step(b_acc2, b_w, b_s, x, o_k, m_k, t0 + 2, M, s_xm,
                               BLOCK_M, F32_DOT, EMULATE, X_MAJOR, EVEN)
            b_acc3 = tile_step(b_acc3, b_w, b_s, x, o_k, m_k, t0 + 3, M, s_xm,
                               BLOCK_M, F32_DOT, EMULATE, X_MAJOR, EVEN)
        if M_TILES > 4:
            b_acc4 = tile_step(b_acc4, b_w, b_s, x, o_k, m_k, t0 + 4, M, s_xm,
                               BLOCK_M, F32_DOT, EMULATE, X_MAJOR, EVEN)
            b_acc5 = tile_step(b_acc5, b_w, b_s, x, o_k, m_k, t0 + 5, M, s_xm,
                               BLOCK_M, F32_DOT, EMULATE, X_MAJOR, EVEN)
            b_acc6 = tile_step(b_acc6, b_w, b_s, x, o_k, m_k, t0 + 6, M, s_xm,
                               BLOCK_M, F32_DOT, EMULATE, X_MAJOR, EVEN)
            b_acc7 = tile_step(b_acc7, b_w, b_s, x, o_k, m_k, t0 + 7, M, s_xm,
                               BLOCK_M, F32_DOT, EMULATE, X_MAJOR, EVEN)

    row_tile_store(tile_out(b_acc0, X_MAJOR), t0, o_n, m_n, b, y, ws, i_s, M, N, s_ym,
                   SPLIT_K, HAS_BIAS, BLOCK_M)
    if M_TILES > 1:
        row_tile_store(tile_out(b_acc1, X_MAJOR), t0 + 1, o_n, m_n, b, y, ws, i_s, M, N,
                       s_ym, SPLIT_K, HAS_BIAS, BLOCK_M)
    if M_TILES > 2:
        row_tile_store(tile_out(b_acc2, X_MAJOR), t0 + 2, o_n, m_n, b, y, ws, i_s, M, N,
                       s_ym, SPLIT_K, HAS_BIAS, BLOCK_M)
        row_tile_store(tile_out(b_acc3, X_MAJOR), t0 + 3, o_n, m_n, b, y, ws, i_s, M, N,
                       s_ym, SPLIT_K, HAS_BIAS, BLOCK_M)
    if M_TILES > 4:
        row_tile_store(tile_out(b_acc4, X_MAJOR), t0 + 4, o_n, m_n, b, y, ws, i_s, M, N,
                       s_ym, SPLIT_K, HAS_BIAS, BLOCK_M)
        row_tile_store(tile_out(b_acc5, X_MAJOR), t0 + 5, o_n, m_n, b, y, ws, i_s, M, N,
                       s_ym, SPLIT_K, HAS_BIAS, BLOCK_M)
        row_tile_store(tile_out(b_acc6, X_MAJOR), t0 + 6, o_n, m_n, b, y, ws, i_s, M, N,
                       s_ym, SPLIT_K, HAS_BIAS, BLOCK_M)
        row_tile_store(tile_out(b_acc7, X_MAJOR), t0 + 7, o_n, m_n, b, y, ws, i_s, M, N,
                       s_ym, SPLIT_K, HAS_BIAS, BLOCK_M)
    if SPLIT_K > 1 and FIXUP:
        last_split_reduces(ws, b, y, counters, t0, o_n, m_n, M, N, s_ym,
                           SPLIT_K, HAS_BIAS, BLOCK_M, M_TILES, BLOCK_N)


def launch_fp8_linear(
    x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, bias: torch.Tensor | None,
    block: tuple[int, int], out: torch.Tensor | None, config: Fp8LinearConfig | None = None,
) -> torch.Tensor:
    """Launch :func:`fp8_linear_kernel` (and the reduction pass) on validated inputs.

    ``config`` overrides :func:`fp8_linear_config` (tests and benchmark sweeps only:
    another config is another reduction order).
    """
    N, K = weight.shape
    bn, bk = block
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
    plan = fp8_linear_launch(M, N, K, x.dtype, block, config)
    cfg, split = plan.config, plan.split
    ws = (torch.empty(split, M, N, dtype=torch.float32, device=x.device) if split > 1
          else y2)
    b = scale_inv if bias is None else bias
    # the in-kernel reduction up to two row tiles (32 rows): past them its registers spill
    # (sm_90: 16 bytes at 4 tiles, 408 at 8), and the reduction pass costs the same
    counters = (split_counters(x.device, plan.grid[0] * plan.grid[1])
                if split > 1 and plan.m_tiles <= 2 else None)
    fp8_linear_kernel[plan.grid](
        x2, weight, scale_inv, b, y2, ws, ws if counters is None else counters,
        M, N, K, x2.stride(0), weight.stride(0),
        scale_inv.stride(0), scale_inv.stride(1), y2.stride(0),
        BN=bn, BK=bk, K_BLOCKS=triton.cdiv(K, bk), K_BLOCKS_PER_SPLIT=plan.k_blocks_per_split,
        SPLIT_K=split, HAS_BIAS=bias is not None,
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, BLOCK_M=BLOCK_M, M_TILES=plan.m_tiles,
        F32_DOT=x.dtype == torch.float32, EMULATE=INTERPRET, X_MAJOR=cfg.x_major,
        # the PTX conversion in compiled kernels only (the interpreter runs no PTX)
        BITS=cfg.bit_convert and x.dtype == torch.bfloat16 and not INTERPRET,
        EVEN=plan.even, FIXUP=counters is not None,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if split > 1 and counters is None:
        linear_reduce_kernel[(triton.cdiv(N, BLOCK_REDUCE), M)](
            ws, b, y2, M, N, y2.stride(0),
            SPLIT_K=split, HAS_BIAS=bias is not None, BLOCK=BLOCK_REDUCE, num_warps=4,
        )
    return out
