"""Triton kernel: depthwise causal conv1d (+ SiLU) that captures its input rows.

One program per (batch, channel block) covers all ``T`` tokens, in three phases:

1. load the ``Kc - 1`` previous rows (``conv_rows``, any strides), then a CTA barrier;
2. write ``captured[:, : Kc-1+T] = concat(conv_rows, x)``, then a CTA barrier;
3. compute ``y`` from ``captured``, which now holds the whole input window;
4. with ``ADVANCE`` (a decode or prefill that keeps its tokens), copy the window after the
   ``T`` tokens (``captured`` rows ``T .. T+Kc-2``) into ``conv_rows``: one launch fewer.

With a tree's path table (``HAS_PATHS``, ``B == 1``), phase 3 gathers token ``t``'s window
through the table instead of reading rows ``t .. t+Kc-1``: tap ``j`` reads entry
``i = depth(t) + j`` of ``concat(conv_rows, x[path_t])``, i.e. captured row ``i`` while
``i < Kc-1`` and row ``Kc-1 + paths[t, i-(Kc-1)]`` after it. ``depth(t)`` is counted from
the table on the device (its non-negative entries in columns ``0..t``), so nothing is read
on the host. Table entries are masked to their valid ranges, so a malformed table cannot
read out of bounds.

Phase 1 finishes before any write, and a program only touches its own channels, so
``conv_rows`` may be a view of ``captured`` itself (slot remap). The barrier after phase 2
makes this program's writes visible to all of its threads before phase 3 reads them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit(do_not_specialize=["T"])  # type: ignore[untyped-decorator]  # triton ships no types
def causal_conv1d_capture_kernel(  # type: ignore[no-untyped-def]  # Triton pointers are untyped
    x, rows, w, bias, cap, y, paths,   # [B,T,C], [B,Kc-1,C], [C,Kc], [C], [B,Kc-1+S,C], [B,T,C],
    T, C,                              # [T,T] int32 (HAS_PATHS only)
    s_x_b, s_x_t, s_r_b, s_r_t, s_r_c, s_w_c, s_w_k, s_c_b, s_c_t, s_y_b, s_y_t, s_p_t, s_p_d,
    KC: tl.constexpr, BW: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, BD: tl.constexpr,
    HAS_BIAS: tl.constexpr, SILU: tl.constexpr, HAS_PATHS: tl.constexpr,
    ADVANCE: tl.constexpr,
):
    i_b = tl.program_id(0).to(tl.int64)
    i_c = tl.program_id(1).to(tl.int64)
    o_c = i_c * BC + tl.arange(0, BC)
    m_c = o_c < C
    o_w = tl.arange(0, BW)
    m_w = (o_w < KC - 1)[:, None] & m_c[None, :]
    o_t = tl.arange(0, BT)

    # 1. the previous Kc-1 inputs, read before anything is written (alias safety)
    b_prev = tl.load(rows + i_b * s_r_b + o_w[:, None] * s_r_t + o_c[None, :] * s_r_c, mask=m_w)
    tl.debug_barrier()

    # 2. the capture: captured rows 0..Kc-2 <- previous rows, rows Kc-1.. <- x
    p_cap = cap + i_b * s_c_b + o_c[None, :]
    tl.store(p_cap + o_w[:, None] * s_c_t, b_prev.to(cap.dtype.element_ty), mask=m_w)
    t0 = T * 0  # an int32 scalar, like the loop bound
    while t0 < T:  # a while loop: the interpreter cannot range() over a runtime bound
        m_xt = ((t0 + o_t) < T)[:, None] & m_c[None, :]
        b_x = tl.load(x + i_b * s_x_b + (t0 + o_t)[:, None] * s_x_t + o_c[None, :], mask=m_xt)
        tl.store(p_cap + (KC - 1 + t0 + o_t)[:, None] * s_c_t, b_x.to(cap.dtype.element_ty),
                 mask=m_xt)
        t0 += BT
    tl.debug_barrier()

    # 3. y[t] = act(bias + sum_j w[:, j] * captured[row(t, j)]), row(t, j) = t + j for a
    #    chain, the row of entry depth(t) + j of token t's history for a tree
    b_bias = tl.zeros([BC], dtype=tl.float32)
    if HAS_BIAS:
        b_bias = tl.load(bias + o_c, mask=m_c, other=0).to(tl.float32)
    o_d = tl.arange(0, BD)
    t0 = T * 0  # an int32 scalar, like the loop bound
    while t0 < T:
        m_t = (t0 + o_t) < T
        m_xt = m_t[:, None] & m_c[None, :]
        if HAS_PATHS:
            # depth(t) + 1 = the non-negative entries of row t; they lie in columns 0..t
            p_row = paths + (t0 + o_t).to(tl.int64) * s_p_t  # [BT]
            b_n = tl.zeros([BT], dtype=tl.int32)
            d0 = T * 0
            while d0 < t0 + BT:
                m_d = m_t[:, None] & ((d0 + o_d)[None, :] <= (t0 + o_t)[:, None])
                b_p = tl.load(p_row[:, None] + (d0 + o_d)[None, :] * s_p_d, mask=m_d, other=-1)
                b_n += tl.sum((b_p >= 0).to(tl.int32), axis=1)
                d0 += BD
            b_depth = b_n - 1
        acc = tl.zeros([BT, BC], dtype=tl.float32) + b_bias[None, :]
        for j in tl.static_range(KC):
            b_wj = tl.load(w + o_c * s_w_c + j * s_w_k, mask=m_c, other=0).to(tl.float32)
            if HAS_PATHS:
                i = b_depth + j  # entry of concat(conv_rows, x[path_t]); [BT]
                m_x = m_t & (i >= KC - 1) & (i < KC - 1 + T)
                b_slot = tl.load(p_row + (i - (KC - 1)) * s_p_d, mask=m_x, other=0)
                b_row = tl.where(i < KC - 1, i, KC - 1 + b_slot)
                m_in = m_t & (b_row >= 0) & (b_row < KC - 1 + T)
                b_in = tl.load(p_cap + b_row.to(tl.int64)[:, None] * s_c_t,
                               mask=m_in[:, None] & m_c[None, :], other=0)
            else:
                b_in = tl.load(p_cap + (t0 + o_t + j)[:, None] * s_c_t, mask=m_xt, other=0)
            acc += b_wj[None, :] * b_in.to(tl.float32)
        if SILU:
            acc = acc * tl.sigmoid(acc)
        p_y = y + i_b * s_y_b + (t0 + o_t)[:, None] * s_y_t + o_c[None, :]
        tl.store(p_y, acc.to(y.dtype.element_ty), mask=m_xt)
        t0 += BT

    # 4. (ADVANCE) the window after all T tokens into conv_rows: captured rows T..T+Kc-2,
    #    this program's channels (written in phase 2, visible after its barrier)
    if ADVANCE:
        b_win = tl.load(p_cap + (T + o_w)[:, None] * s_c_t, mask=m_w)
        tl.store(rows + i_b * s_r_b + o_w[:, None] * s_r_t + o_c[None, :] * s_r_c,
                 b_win.to(rows.dtype.element_ty), mask=m_w)


def launch_causal_conv1d_capture(
    x: torch.Tensor, conv_rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
    captured: torch.Tensor, *, activation: str | None, out: torch.Tensor | None = None,
    paths: torch.Tensor | None = None, advance_rows: bool = False, block_c: int = 128,
) -> torch.Tensor:
    """Launch :func:`causal_conv1d_capture_kernel` on validated inputs; returns ``y``.

    ``out`` (validated: contiguous ``[B, T, C]`` in x's dtype) receives ``y``; ``None``
    allocates it. ``paths`` (validated: int32 ``[T, T]``, ``B == 1``) makes it a tree call;
    ``advance_rows`` (a chain, ``conv_rows`` apart from ``captured``) leaves the window after
    the ``T`` tokens in ``conv_rows``.
    """
    B, T, C = x.shape
    Kc = weight.shape[1]
    x = x if x.stride(2) == 1 else x.contiguous()
    y = torch.empty_like(x, memory_format=torch.contiguous_format) if out is None else out
    BC = min(block_c, triton.next_power_of_2(C))
    grid = (B, triton.cdiv(C, BC))
    causal_conv1d_capture_kernel[grid](
        x, conv_rows, weight, bias, captured, y, paths,
        T, C,
        x.stride(0), x.stride(1), *conv_rows.stride(), *weight.stride(),
        captured.stride(0), captured.stride(1), y.stride(0), y.stride(1),
        *(paths.stride() if paths is not None else (0, 0)),
        KC=Kc, BW=triton.next_power_of_2(max(Kc - 1, 1)), BT=16, BC=BC, BD=32,
        HAS_BIAS=bias is not None, SILU=activation == "silu", HAS_PATHS=paths is not None,
        ADVANCE=advance_rows, num_warps=4,
    )
    return y
