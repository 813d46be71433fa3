"""Depthwise causal conv1d with input capture, as plain torch loops (the reference).

With ``xin = concat(conv_rows, x)`` along time (``Kc - 1`` previous inputs, oldest first,
then the ``T`` new ones) and ``weight[c, Kc-1]`` applied to the newest input:

    y[b, t, c] = act(bias[c] + sum_j weight[c, j] * xin[b, t + j, c])

and ``captured[:, : Kc-1+T] <- xin``, so the window after accepting ``n`` tokens is
``captured[:, n : n+Kc-1]``. Arithmetic runs in float64 when ``x`` is float64, else float32.
"""

from __future__ import annotations

import torch


def causal_conv1d_capture_reference(
    x: torch.Tensor,              # [B, T, C]
    conv_rows: torch.Tensor,      # [B, Kc-1, C]
    weight: torch.Tensor,         # [C, Kc]
    bias: torch.Tensor | None,    # [C]
    captured: torch.Tensor,       # [B, Kc-1+S, C], S >= T
    *,
    activation: str | None = "silu",
    out: torch.Tensor | None = None,  # [B, T, C] in x's dtype
) -> torch.Tensor:
    """Reference twin of :func:`dflash.kernels.causal_conv1d_capture`."""
    T = x.shape[1]
    Kc = weight.shape[1]
    dt = torch.float64 if x.dtype == torch.float64 else torch.float32
    # Read the previous rows before writing anything: they may be a view of `captured`.
    xin = torch.cat([conv_rows.to(x.dtype), x], dim=1)   # [B, Kc-1+T, C]
    captured[:, : Kc - 1 + T] = xin.to(captured.dtype)

    xf, w = xin.to(dt), weight.to(dt)
    # Taps in order j = 0 … Kc-1 for every token at once: products and sums are correctly
    # rounded element by element, so a token's pre-activation does not depend on T.
    acc = torch.zeros_like(xf[:, :T]) if bias is None else bias.to(dt).expand_as(xf[:, :T])
    for j in range(Kc):
        acc = acc + w[:, j] * xf[:, j : j + T]
    y = acc  # a new tensor: the tap loop ran at least once
    if activation == "silu":
        for t in range(T):  # the activation token by token: a [B, C] call whatever T is
            a = y[:, t]
            a.mul_(torch.sigmoid(a))
    if out is None:
        return y.to(x.dtype)
    out.copy_(y)
    return out
