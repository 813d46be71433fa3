"""Torch reference of the M-invariant linear kernel (same signature as :func:`linear`).

A plain loop over rows: each output row is one matrix-vector product of the weight with
that row alone, in float32 (float64 for float64 inputs), rounded once to the input dtype.
A row's bits therefore depend on that row only, never on how many rows share the call.
"""

from __future__ import annotations

import torch


def linear_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``out[..., n] = sum_k x[..., k] * weight[n, k] (+ bias[n])``, one row at a time.

    Arguments as :func:`dflash.kernels.linear` (already validated there).
    """
    K, N = x.shape[-1], weight.shape[0]
    acc_dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    rows = x.reshape(-1, K)
    w = weight.to(acc_dtype)                       # [N, K]
    b = None if bias is None else bias.to(acc_dtype)
    y = torch.empty(rows.shape[0], N, dtype=x.dtype, device=x.device)
    for m in range(rows.shape[0]):
        # a fresh, aligned copy: the vector kernel then sees the same buffer layout for a
        # row wherever it sat in the call
        r = rows[m].to(acc_dtype, copy=True)
        acc = torch.mv(w, r)
        if b is not None:
            acc = acc + b
        y[m] = acc.to(x.dtype)
    if out is None:
        return y.view(*x.shape[:-1], N)
    out.copy_(y.view(out.shape))
    return out
