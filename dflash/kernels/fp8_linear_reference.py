"""Torch reference of the M-invariant float8 weight-only linear (same signature as
:func:`dflash.kernels.fp8_linear`, without ``backend``).

A loop over rows, and inside a row over the scale blocks of K in ascending order. For
row ``m`` and K block ``j`` (columns ``j*bk … min((j+1)*bk, K) - 1``)::

    p   = W_j @ x[m, block j]                     # torch.mv, W_j = float(weight[:, block j])
    acc = acc + p * scale_inv[n // bn, j]         # per output n; acc starts at 0
    y[m] = (acc (+ bias)).to(x.dtype)             # rounded once

in float32 (float64 for float64 x). These are the Triton kernel's operations in its
order: the block's partial sums on the raw e4m3 values (exact in every compute dtype),
then one scale per ``(n block, k block)``, then the running sum (the kernel fuses the
scale and the sum into one fma, rounding once where this rounds twice). A row's bits depend on
that row only, never on how many rows share the call.
"""

from __future__ import annotations

import torch


def fp8_linear_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale_inv: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    block: tuple[int, int] = (128, 128),
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``out[..., n] = sum_j (sum_{k in block j} x[..., k] * weight[n, k]) *
    scale_inv[n // bn, j] (+ bias[n])``, one row and one K block at a time.

    Arguments as :func:`dflash.kernels.fp8_linear` (already validated there).
    """
    K, N = x.shape[-1], weight.shape[0]
    bn, bk = block
    acc_dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    rows = x.reshape(-1, K)
    starts = range(0, K, bk)
    w = weight.to(acc_dtype)                                        # [N, K], exact
    w_blocks = [w[:, k0 : k0 + bk].contiguous() for k0 in starts]   # [N, <= bk] each
    s = scale_inv.to(acc_dtype).repeat_interleave(bn, dim=0)[:N]    # [N, KB]: row n's scales
    s_cols = [s[:, j].contiguous() for j in range(len(w_blocks))]   # [N] each
    b = None if bias is None else bias.to(acc_dtype)
    y = torch.empty(rows.shape[0], N, dtype=x.dtype, device=x.device)
    for m in range(rows.shape[0]):
        acc = torch.zeros(N, dtype=acc_dtype, device=x.device)
        for j, k0 in enumerate(starts):
            # a fresh, aligned copy: the vector kernel then sees the same buffer layout
            # for a row wherever it sat in the call
            r = rows[m, k0 : k0 + bk].to(acc_dtype, copy=True)
            acc = acc + torch.mv(w_blocks[j], r) * s_cols[j]
        if b is not None:
            acc = acc + b
        y[m] = acc.to(x.dtype)
    if out is None:
        return y.view(*x.shape[:-1], N)
    out.copy_(y.view(out.shape))
    return out
