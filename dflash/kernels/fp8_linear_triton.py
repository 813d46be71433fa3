"""Triton kernel: skinny GEMM ``y = x @ dequant(w).T + b`` on a block-scaled float8
weight, whose rows do not depend on M.

The weight stays in HBM as float8 e4m3 (one byte per element, half the bytes of bf16:
decode is a stream over the weights, so the bytes are the time) with one float32 scale
per ``bn × bk`` block. The layout and the row invariance are those of
:mod:`dflash.kernels.linear_triton`, whose row-tile product (:func:`mma`), store
(:func:`row_tile_store`) and split-K reduction pass (:func:`linear_reduce_kernel`) this
kernel shares:

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
  whole K blocks and writes float32 partial sums to a workspace, and a second pass adds
  the splits in ascending order (then the bias) and rounds once — no atomics.

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

``M`` is a runtime argument that Triton never specialises (``do_not_specialize``).
"""

from __future__ import annotations

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
    linear_reduce_kernel,
    m_tiles_for,
    mma,
    row_tile_store,
)

#: the widest scale block along K the kernel walks in one step (one K tile per block)
MAX_BLOCK_K = 128
#: scale blocks along K must be a multiple of this (the smallest MMA depth)
MIN_BLOCK_K = 16


@dataclass(frozen=True)
class Fp8LinearConfig:
    """One launch configuration: the N tile, the K tile (the scale block ``bk`` padded
    to a power of two), the split-K count and Triton launch options."""

    block_n: int
    block_k: int
    split_k: int
    num_warps: int
    num_stages: int
    #: read the weight as int32 words of four e4m3 bytes (:func:`e4m3_word_values`; the
    #: values are the byte tile's, bit for bit). Off: on an H200 (triton 3.6) it is
    #: 24-38 % slower than the byte tile at every 9B shape, which the software pipeline
    #: already copies with 8-byte ``cp.async`` (BENCHMARKS.md, "The weight read as int32
    #: words"). Taken only where K, the row stride and the address are multiples of 4.
    words: bool = False


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


def fp8_linear_config(
    N: int, K: int, dtype: torch.dtype, block: tuple[int, int] = (128, 128), m_tiles: int = 1
) -> Fp8LinearConfig:
    """The configuration for an ``[N, K]`` float8 weight with scale blocks ``block``, x of
    ``dtype`` and ``m_tiles`` row tiles per program.

    Tiles and the split-K count depend on ``N``, ``K``, ``block`` only (they fix the
    reduction order); ``dtype`` and ``m_tiles`` set the pipeline depth alone.

    - ``BLOCK_K``: the scale block ``bk`` rounded up to a power of two (128 for the
      checkpoints' 128 × 128 blocks: 128-byte weight rows per load);
    - ``BLOCK_N = 64`` (the Hopper warp-group MMA height), smaller only for ``N < 64``;
    - split-K as :func:`dflash.kernels.linear_triton.linear_config`: it doubles while the
      doubled grid of one row group stays within ``TARGET_PROGRAMS`` (264) programs and
      each split keeps at least ``MIN_K_BLOCKS`` (4) K blocks. At the 9B shapes with
      128 × 128 blocks: split 4 for N = 4096 (K = 4096 or 12288; 256 programs), 1 for
      N = 12288 (192);
    - 4 warps; pipeline stages 4 (3 for float32 x), fewer when a stage (one float8
      weight tile plus ``m_tiles`` row tiles) would push the pipeline past
      ``STAGE_BYTES``, never fewer than ``MIN_STAGES``. bf16, 128 × 128 blocks: a stage
      is 12, 16, 24, 40 KB for 1, 2, 4, 8 tiles, so 4, 4, 4, 2 stages.
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
    block_n = 64 if N >= 64 else max(16, int(triton.next_power_of_2(N)))
    n_tiles = triton.cdiv(N, block_n)
    k_blocks = triton.cdiv(K, bk)
    split = 1
    while n_tiles * 2 * split <= TARGET_PROGRAMS and k_blocks // (2 * split) >= MIN_K_BLOCKS:
        split *= 2
    stage = block_n * block_k + m_tiles * BLOCK_M * block_k * dtype.itemsize
    stages = max(MIN_STAGES, min(3 if dtype == torch.float32 else 4, STAGE_BYTES // stage))
    return Fp8LinearConfig(block_n, block_k, split, num_warps=4, num_stages=stages)


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
    return Fp8LinearLaunch(cfg, tiles, per_split, split, grid)


@triton.jit  # type: ignore[untyped-decorator]  # triton ships no types
def row_tile_scaled_dot(  # type: ignore[no-untyped-def]  # Triton values are untyped
    b_acc, b_w, b_s, x, o_k, m_k, i_t, M, s_xm,
    BLOCK_M: tl.constexpr, F32_DOT: tl.constexpr, EMULATE: tl.constexpr,
):
    """``b_acc + (b_w @ x[rows of tile i_t, o_k].T) * b_s[:, None]``: one row tile's K
    block, its product summed from zero in float32, then scaled (rows past M load
    zeros). ``b_acc [BLOCK_N, BLOCK_M]`` is the tile's output, transposed; ``b_s
    [BLOCK_N]`` the block's scale of each output row."""
    o_m = i_t * BLOCK_M + tl.arange(0, BLOCK_M)
    p_x = x + o_m[None, :] * s_xm + o_k[:, None]
    b_x = tl.load(p_x, mask=m_k[:, None] & (o_m < M)[None, :], other=0)   # [BLOCK_K, BLOCK_M]
    b_p = mma(b_w, b_x, tl.zeros_like(b_acc), F32_DOT, EMULATE)
    # one explicit fused multiply-add: a multiply then an add may be contracted into an
    # fma or not at the compiler's choice; spelled out, every variant rounds alike
    return tl.fma(b_p, b_s[:, None], b_acc)


@triton.jit  # type: ignore[untyped-decorator]  # triton ships no types
def e4m3_word_values(words, DTYPE: tl.constexpr):  # type: ignore[no-untyped-def]  # untyped
    """``words [R, C]`` int32, each four e4m3 bytes (little-endian: byte ``i`` is column
    ``4c + i``) → ``[R, 4C]`` of ``DTYPE``, by the same conversion as a byte tile's
    (``.to(DTYPE)``), so the values are those bit for bit."""
    b0 = (words & 0xFF).to(tl.int8).to(tl.float8e4nv, bitcast=True)
    b1 = ((words >> 8) & 0xFF).to(tl.int8).to(tl.float8e4nv, bitcast=True)
    b2 = ((words >> 16) & 0xFF).to(tl.int8).to(tl.float8e4nv, bitcast=True)
    b3 = ((words >> 24) & 0xFF).to(tl.int8).to(tl.float8e4nv, bitcast=True)
    # join(join(b0, b2), join(b1, b3))[..., a, b] is b(2a + b): rows of b0 b1 b2 b3
    v = tl.join(tl.join(b0, b2), tl.join(b1, b3))
    return tl.reshape(v, [words.shape[0], 4 * words.shape[1]]).to(DTYPE)


@triton.jit(do_not_specialize=["M"])  # type: ignore[untyped-decorator]  # triton ships no types
def fp8_linear_kernel(  # type: ignore[no-untyped-def]  # Triton pointers are untyped
    x, w, s, b, y, ws,       # x [M, K] (s_xm), w [N, K] e4m3 (s_wn), s [NB, KB] f32, b [N]
    M, N, K, s_xm, s_wn, s_sn, s_sk, s_ym,   # y [M, N] (s_ym); ws [SPLIT_K, M, N] float32
    BN: tl.constexpr, BK: tl.constexpr, K_BLOCKS: tl.constexpr,
    K_BLOCKS_PER_SPLIT: tl.constexpr, SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_M: tl.constexpr,
    M_TILES: tl.constexpr, F32_DOT: tl.constexpr, EMULATE: tl.constexpr,
    WORDS: tl.constexpr,
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

    # one accumulator per row tile (y tile, transposed), unrolled as in linear_kernel
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
    # one scale block per step, ascending; the last split may run past the last block
    # (every load masked: it adds zeros)
    for j in range(0, K_BLOCKS_PER_SPLIT):
        kb = kb0 + j
        o_k = kb * BK + o_kk
        m_k = (o_kk < BK) & (o_k < K)
        if WORDS:  # w is an int32 view: [N, K // 4] words of four bytes, row stride s_wn
            o_q = tl.arange(0, BLOCK_K // 4)
            m_q = (4 * o_q < BK) & (kb * BK + 4 * o_q < K)
            p_w = w + o_n[:, None] * s_wn + (kb * (BK // 4) + o_q)[None, :]
            b_q = tl.load(p_w, mask=m_n[:, None] & m_q[None, :], other=0)
            b_w = e4m3_word_values(b_q, x.dtype.element_ty)  # [BLOCK_N, BLOCK_K]
        else:
            p_w = w + o_n[:, None] * s_wn + o_k[None, :]
            # [BLOCK_N, BLOCK_K] e4m3; ``other`` a float zero (Triton casts no int to
            # float8)
            b_w = tl.load(p_w, mask=m_n[:, None] & m_k[None, :], other=0.0)
            b_w = b_w.to(x.dtype.element_ty)  # exact: e4m3 fits f16, bf16 and f32
        # the block bound as a [BLOCK_N] comparison: a scalar and-ed into the mask makes a
        # mask of another dtype under some interpreters
        m_s = m_n & ((o_n * 0 + kb) < K_BLOCKS)
        b_s = tl.load(p_s + kb * s_sk, mask=m_s, other=0)   # [BLOCK_N]
        b_acc0 = row_tile_scaled_dot(b_acc0, b_w, b_s, x, o_k, m_k, t0, M, s_xm,
                                     BLOCK_M, F32_DOT, EMULATE)
        if M_TILES > 1:
            b_acc1 = row_tile_scaled_dot(b_acc1, b_w, b_s, x, o_k, m_k, t0 + 1, M, s_xm,
                                         BLOCK_M, F32_DOT, EMULATE)
        if M_TILES > 2:
            b_acc2 = row_tile_scaled_dot(b_acc2, b_w, b_s, x, o_k, m_k, t0 + 2, M, s_xm,
                                         BLOCK_M, F32_DOT, EMULATE)
            b_acc3 = row_tile_scaled_dot(b_acc3, b_w, b_s, x, o_k, m_k, t0 + 3, M, s_xm,
                                         BLOCK_M, F32_DOT, EMULATE)
        if M_TILES > 4:
            b_acc4 = row_tile_scaled_dot(b_acc4, b_w, b_s, x, o_k, m_k, t0 + 4, M, s_xm,
                                         BLOCK_M, F32_DOT, EMULATE)
            b_acc5 = row_tile_scaled_dot(b_acc5, b_w, b_s, x, o_k, m_k, t0 + 5, M, s_xm,
                                         BLOCK_M, F32_DOT, EMULATE)
            b_acc6 = row_tile_scaled_dot(b_acc6, b_w, b_s, x, o_k, m_k, t0 + 6, M, s_xm,
                                         BLOCK_M, F32_DOT, EMULATE)
            b_acc7 = row_tile_scaled_dot(b_acc7, b_w, b_s, x, o_k, m_k, t0 + 7, M, s_xm,
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


def words_fit(weight: torch.Tensor) -> bool:
    """Whether an ``[N, K]`` e4m3 weight can be read as int32 words: contiguous rows, K
    and the row stride multiples of 4, the address 4-byte aligned."""
    K = weight.shape[1]
    return (weight.stride(1) == 1 and K % 4 == 0 and weight.stride(0) % 4 == 0
            and weight.data_ptr() % 4 == 0)


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
    words = cfg.words and words_fit(weight)
    w = weight.view(torch.int32) if words else weight
    fp8_linear_kernel[plan.grid](
        x2, w, scale_inv, b, y2, ws, M, N, K, x2.stride(0), w.stride(0),
        scale_inv.stride(0), scale_inv.stride(1), y2.stride(0),
        BN=bn, BK=bk, K_BLOCKS=triton.cdiv(K, bk), K_BLOCKS_PER_SPLIT=plan.k_blocks_per_split,
        SPLIT_K=split, HAS_BIAS=bias is not None,
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, BLOCK_M=BLOCK_M, M_TILES=plan.m_tiles,
        F32_DOT=x.dtype == torch.float32, EMULATE=INTERPRET, WORDS=words,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if split > 1:
        linear_reduce_kernel[(triton.cdiv(N, BLOCK_REDUCE), M)](
            ws, b, y2, M, N, y2.stride(0),
            SPLIT_K=split, HAS_BIAS=bias is not None, BLOCK=BLOCK_REDUCE, num_warps=4,
        )
    return out
