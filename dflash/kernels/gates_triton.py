"""Triton kernel: Gated DeltaNet's two gates in one launch instead of eight.

``beta = sigmoid(b)`` and ``g = -exp(A_log) · softplus(a + dt_bias)`` element by element
(float32 maths), one program per row of ``[R, HV]``: a row's result depends on that row
alone, so decode and verify rows agree bit for bit (M-invariance). ``a`` and ``b`` may be
column slices of a wider buffer (the grouped input projection's output): rows are read
through their row stride, nothing is copied.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

#: softplus(x) = x above this (torch's default threshold), log1p(exp(x)) below
SOFTPLUS_THRESHOLD = tl.constexpr(20.0)  # a constexpr: compiled kernels read no plain globals


@triton.jit  # type: ignore[untyped-decorator]  # triton ships no types
def gdn_gates_kernel(  # type: ignore[no-untyped-def]  # Triton pointers are untyped
    a, b, A_log, dt_bias, beta, g,   # a, b: [R, HV] with row strides; beta, g: [R, HV] contiguous
    stride_a, stride_b, HV,
    BH: tl.constexpr,
):
    i_r = tl.program_id(0).to(tl.int64)
    o_h = tl.arange(0, BH)
    m_h = o_h < HV
    b_a = tl.load(a + i_r * stride_a + o_h, mask=m_h, other=0).to(tl.float32)
    b_b = tl.load(b + i_r * stride_b + o_h, mask=m_h, other=0).to(tl.float32)
    b_A = tl.load(A_log + o_h, mask=m_h, other=0).to(tl.float32)
    b_dt = tl.load(dt_bias + o_h, mask=m_h, other=0).to(tl.float32)
    x = b_a + b_dt
    # log1p(e) from plain log, accurate to a few ulps (Goldberg): log(u) * e / (u - 1) with
    # u = 1 + e rounded; when u rounds to 1, log1p(e) = e to float32 precision
    e = tl.exp(tl.minimum(x, SOFTPLUS_THRESHOLD))
    u = 1.0 + e
    d = u - 1.0
    log1p_e = tl.where(d == 0.0, e, tl.log(u) * (e / tl.where(d == 0.0, 1.0, d)))
    soft = tl.where(x > SOFTPLUS_THRESHOLD, x, log1p_e)
    tl.store(g + i_r * HV + o_h, -tl.exp(b_A) * soft, mask=m_h)
    tl.store(beta + i_r * HV + o_h, tl.sigmoid(b_b).to(beta.dtype.element_ty), mask=m_h)


def launch_gdn_gates(
    a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
    beta_out: torch.Tensor | None, g_out: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch :func:`gdn_gates_kernel` on validated inputs (rows given as ``[R, HV]`` views)."""
    HV = a.shape[-1]
    a2, b2 = a.reshape(-1, HV), b.reshape(-1, HV)  # views: validated collapsible
    beta = torch.empty(b.shape, dtype=b.dtype, device=b.device) if beta_out is None else beta_out
    g = torch.empty(a.shape, dtype=torch.float32, device=a.device) if g_out is None else g_out
    rows = a2.shape[0]
    if rows:
        gdn_gates_kernel[(rows,)](
            a2, b2, A_log.contiguous(), dt_bias.contiguous(), beta, g,
            a2.stride(0), b2.stride(0), HV, BH=triton.next_power_of_2(HV), num_warps=1,
        )
    return beta, g
