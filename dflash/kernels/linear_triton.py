"""Triton kernel: skinny GEMM ``y = x @ w.T + b`` whose rows do not depend on M.

Decode and verify forwards multiply a handful of rows (M = 1 … 64) by large weights, so
the work is a stream over the weight. The reduction order of every output element is fixed
by ``(N, K)`` alone:

- rows travel in FIXED 16-row tiles (masked; one grid row of tiles per 16 rows): a
  ``[BLOCK_N, BLOCK_K] x [BLOCK_K, 16]`` product per step, the weight tile on the MMA's
  large side, the rows on its 16-wide side. An output element depends on its own row of x
  and the weight only — never on the other rows of the tile, nor on M;
- K is walked in ascending ``BLOCK_K`` blocks; ``BLOCK_N``, ``BLOCK_K`` and the split-K
  count come from :func:`linear_config` ``(N, K, dtype)``, never from M;
- with split-K, each split writes its float32 partial sums to a workspace and a second
  pass adds the splits in ascending order (then the bias) and rounds once — no atomics.

``M`` is a runtime argument that Triton never specialises (``do_not_specialize``), so a
1-row and a 16-row call run the same binary (17 … 64 rows add row tiles to the grid).

Under the Triton interpreter (CPU tests) the tile products are computed by :func:`mma`'s
emulation, whose per-element summation order does not depend on a row's position; the
GPU runs ``tl.dot`` (the MMA computes each output element from its own row and column).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from dflash.kernels.checks import INTERPRET

#: rows per tile: the smallest MMA width, fixed so a row's tile layout never depends on M
BLOCK_M = 16
#: programs the split-K rule aims for: two per SM of a 132-SM H200. A constant (not read
#: from the device) so the split count is a function of the shape only.
TARGET_PROGRAMS = 264
#: fewest K blocks a split must walk: fewer leaves the software pipeline mostly idle
MIN_K_BLOCKS = 4
#: output elements per program of the split-K reduction pass
BLOCK_REDUCE = 512


@dataclass(frozen=True)
class LinearConfig:
    """One launch configuration: tile sizes, split-K count and Triton launch options."""

    block_n: int
    block_k: int
    split_k: int
    num_warps: int
    num_stages: int


def linear_config(N: int, K: int, dtype: torch.dtype) -> LinearConfig:
    """The configuration for an ``[N, K]`` weight (depends on ``N``, ``K``, dtype only).

    - ``BLOCK_K = 128`` for 16-bit weights (256-byte rows per load, 16 KB tiles with
      ``BLOCK_N = 64``), 64 for float32 (the same bytes);
    - ``BLOCK_N = 64`` (the Hopper warp-group MMA height), smaller only for ``N < 64``;
    - split-K doubles while the doubled grid of one 16-row tile stays within
      :data:`TARGET_PROGRAMS` programs and each split keeps at least
      :data:`MIN_K_BLOCKS` K blocks. At the 9B shapes: split 2 for N = 8192 (256
      programs), 4 for N = 4096 with K = 4096 or 12288 (256), 8 for N = 1024 and
      N = 32 (the K-block floor), 1 for N = 12288 (192) and the LM head (3880);
    - 4 warps, 4 pipeline stages (3 for float32): 64 KB of weight in flight per program;
      for sm_90 the 16-bit kernel compiles to a warp-group MMA (64 x 16 x 16) fed by
      asynchronous copies, 80 KB of shared memory, so two programs fit on an SM.
    """
    block_k = 64 if dtype == torch.float32 else 128
    block_n = 64 if N >= 64 else max(16, triton.next_power_of_2(N))
    n_tiles = triton.cdiv(N, block_n)
    k_blocks = triton.cdiv(K, block_k)
    split = 1
    while n_tiles * 2 * split <= TARGET_PROGRAMS and k_blocks // (2 * split) >= MIN_K_BLOCKS:
        split *= 2
    return LinearConfig(block_n, block_k, split, num_warps=4,
                        num_stages=3 if dtype == torch.float32 else 4)


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


@triton.jit(do_not_specialize=["M"])  # type: ignore[untyped-decorator]  # triton ships no types
def linear_kernel(  # type: ignore[no-untyped-def]  # Triton pointers are untyped
    x, w, b, y, ws,          # x [M, K] (row stride s_xm), w [N, K] (s_wn), b [N], y [M, N] (s_ym)
    M, N, K, s_xm, s_wn, s_ym,   # ws [SPLIT_K, M, N] float32 partials (SPLIT_K > 1)
    K_PER_SPLIT: tl.constexpr, SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_M: tl.constexpr,
    F32_DOT: tl.constexpr, EMULATE: tl.constexpr,
):
    i_m = tl.program_id(0).to(tl.int64)   # row tiles vary fastest: they share weight tiles
    i_n = tl.program_id(1).to(tl.int64)
    i_s = tl.program_id(2).to(tl.int64)
    o_m = i_m * BLOCK_M + tl.arange(0, BLOCK_M)
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_m = o_m < M
    m_n = o_n < N
    k0 = i_s * K_PER_SPLIT

    b_acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)   # y tile, transposed
    for kk in range(0, K_PER_SPLIT, BLOCK_K):
        o_k = k0 + kk + tl.arange(0, BLOCK_K)
        m_k = o_k < K
        p_w = w + o_n[:, None] * s_wn + o_k[None, :]
        p_x = x + o_m[None, :] * s_xm + o_k[:, None]
        b_w = tl.load(p_w, mask=m_n[:, None] & m_k[None, :], other=0)   # [BLOCK_N, BLOCK_K]
        b_x = tl.load(p_x, mask=m_k[:, None] & m_m[None, :], other=0)   # [BLOCK_K, BLOCK_M]
        b_acc = mma(b_w, b_x, b_acc, F32_DOT, EMULATE)

    m_y = m_n[:, None] & m_m[None, :]
    if SPLIT_K == 1:
        if HAS_BIAS:
            b_acc += tl.load(b + o_n, mask=m_n, other=0).to(tl.float32)[:, None]
        p_y = y + o_m[None, :] * s_ym + o_n[:, None]
        tl.store(p_y, b_acc.to(y.dtype.element_ty), mask=m_y)
    else:
        p_ws = ws + (i_s * M + o_m[None, :]) * N + o_n[:, None]
        tl.store(p_ws, b_acc, mask=m_y)


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


def launch_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
    out: torch.Tensor | None, config: LinearConfig | None = None,
) -> torch.Tensor:
    """Launch :func:`linear_kernel` (and the reduction pass) on validated inputs.

    ``config`` overrides :func:`linear_config` (benchmark sweeps only: another config is
    another reduction order).
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
    cfg = config or linear_config(N, K, x.dtype)
    k_per_split = triton.cdiv(triton.cdiv(K, cfg.split_k), cfg.block_k) * cfg.block_k
    split = triton.cdiv(K, k_per_split)   # never an empty split
    ws = (torch.empty(split, M, N, dtype=torch.float32, device=x.device) if split > 1
          else y2)
    b = weight if bias is None else bias
    grid = (triton.cdiv(M, BLOCK_M), triton.cdiv(N, cfg.block_n), split)
    linear_kernel[grid](
        x2, weight, b, y2, ws, M, N, K, x2.stride(0), weight.stride(0), y2.stride(0),
        K_PER_SPLIT=k_per_split, SPLIT_K=split, HAS_BIAS=bias is not None,
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, BLOCK_M=BLOCK_M,
        F32_DOT=x.dtype == torch.float32, EMULATE=INTERPRET,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if split > 1:
        linear_reduce_kernel[(triton.cdiv(N, BLOCK_REDUCE), M)](
            ws, b, y2, M, N, y2.stride(0),
            SPLIT_K=split, HAS_BIAS=bias is not None, BLOCK=BLOCK_REDUCE, num_warps=4,
        )
    return out
