"""Triton kernel of :func:`dflash.kernels.act_mul`: ``act(gate) · x`` in one launch.

Programs tile ``[R, N]`` into blocks of one row's columns; each element is computed from
that element alone (float32 maths, the activation rounded to x's dtype before the
product, as the two-launch formulation rounds it), so a row's result does not depend on
the number of rows (M-invariance). ``gate`` and ``x`` are read through their row strides
(a column slice of the grouped projection's output, a head's gate inside ``[query |
gate]`` of one token): nothing is copied where the rows collapse into one stride.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dflash.kernels.rmsnorm_triton import as_rows, rounded

#: columns per program
BLOCK = 1024


@triton.jit  # type: ignore[untyped-decorator]  # triton ships no types
def act_mul_kernel(  # type: ignore[no-untyped-def]  # Triton pointers are untyped
    gate, x, y,  # gate, x: [R, N] with row strides; y: [R, N] contiguous
    stride_g, stride_x, N,
    SILU: tl.constexpr, BN: tl.constexpr,
):
    i_r = tl.program_id(0).to(tl.int64)
    o_n = tl.program_id(1) * BN + tl.arange(0, BN)
    m_n = o_n < N
    dt = y.dtype.element_ty
    b_g = tl.load(gate + i_r * stride_g + o_n, mask=m_n, other=0).to(tl.float32)
    b_x = tl.load(x + i_r * stride_x + o_n, mask=m_n, other=0).to(tl.float32)
    s = 1.0 / (1.0 + tl.exp(-b_g))
    a = b_g * s if SILU else s
    tl.store(y + i_r * N + o_n, rounded(rounded(a, dt) * b_x, dt).to(dt), mask=m_n)


def launch_act_mul(
    gate: torch.Tensor, x: torch.Tensor, act: str, out: torch.Tensor | None
) -> torch.Tensor:
    """Launch :func:`act_mul_kernel` on validated inputs (rows read in place when they
    collapse into one row stride)."""
    N = x.shape[-1]
    g2, x2 = as_rows(gate), as_rows(x)
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device) if out is None else out
    rows = x2.shape[0]
    if rows:
        BN = min(BLOCK, triton.next_power_of_2(N))
        act_mul_kernel[(rows, triton.cdiv(N, BN))](
            g2, x2, y, g2.stride(0), x2.stride(0), N, SILU=act == "silu", BN=BN, num_warps=4,
        )
    return y
