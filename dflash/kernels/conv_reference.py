"""Depthwise causal conv1d with input capture, as plain torch loops (the reference).

With ``xin = concat(conv_rows, x)`` along time (``Kc - 1`` previous inputs, oldest first,
then the ``T`` new ones) and ``weight[c, Kc-1]`` applied to the newest input:

    y[b, t, c] = act(bias[c] + sum_j weight[c, j] * xin[b, t + j, c])

and ``captured[:, : Kc-1+T] <- xin``, so the window after accepting ``n`` tokens is
``captured[:, n : n+Kc-1]``. Arithmetic runs in float64 when ``x`` is float64, else float32.

With a tree's ``paths`` table (``B == 1``), token ``t`` reads the rows of its own history
instead: ``xin[t + j]`` becomes ``hist_t[depth(t) + j]`` with
``hist_t = concat(conv_rows, x[paths[t, : depth(t)+1]])``, the same taps in the same order.
"""

from __future__ import annotations

import torch

from dflash.errors import KernelBoundsError


def causal_conv1d_capture_reference(
    x: torch.Tensor,              # [B, T, C]
    conv_rows: torch.Tensor,      # [B, Kc-1, C]
    weight: torch.Tensor,         # [C, Kc]
    bias: torch.Tensor | None,    # [C]
    captured: torch.Tensor,       # [B, Kc-1+S, C], S >= T
    *,
    activation: str | None = "silu",
    out: torch.Tensor | None = None,  # [B, T, C] in x's dtype
    paths: torch.Tensor | None = None,  # [T, T] int32, B == 1
    advance_rows: bool = False,
) -> torch.Tensor:
    """Reference twin of :func:`dflash.kernels.causal_conv1d_capture`.

    Raises:
        KernelBoundsError: ``paths`` is not the path table of a tree of ``T`` nodes
            (naming the first bad row), before anything is written.
    """
    T = x.shape[1]
    Kc = weight.shape[1]
    dt = torch.float64 if x.dtype == torch.float64 else torch.float32
    # xin row of token t's tap j: t + j for a chain, its history's row for a tree.
    taps = None if paths is None else window_rows(paths, T, Kc).to(x.device)  # [T, Kc]
    # Read the previous rows before writing anything: they may be a view of `captured`.
    xin = torch.cat([conv_rows.to(x.dtype), x], dim=1)   # [B, Kc-1+T, C]
    captured[:, : Kc - 1 + T] = xin.to(captured.dtype)

    xf, w = xin.to(dt), weight.to(dt)
    # Taps in order j = 0 … Kc-1 for every token at once: products and sums are correctly
    # rounded element by element, so a token's pre-activation does not depend on T.
    acc = torch.zeros_like(xf[:, :T]) if bias is None else bias.to(dt).expand_as(xf[:, :T])
    for j in range(Kc):
        acc = acc + w[:, j] * (xf[:, j : j + T] if taps is None else xf[:, taps[:, j]])
    y = acc  # a new tensor: the tap loop ran at least once
    if activation == "silu":
        for t in range(T):  # the activation token by token: a [B, C] call whatever T is
            a = y[:, t]
            a.mul_(torch.sigmoid(a))
    if advance_rows:  # the window after all T tokens
        conv_rows.copy_(xin[:, T : T + Kc - 1])
    if out is None:
        return y.to(x.dtype)
    out.copy_(y)
    return out


def window_rows(paths: torch.Tensor, T: int, Kc: int) -> torch.Tensor:
    """``[T, Kc]`` int64 rows of ``concat(conv_rows, x)`` that token ``t``'s taps read.

    ``paths`` must be the table of :func:`dflash.kernels.tree_paths` for a tree of ``T``
    nodes: row 0 is ``[0, -1, ...]``; row ``t >= 1`` is its parent's path (the parent being
    an earlier slot) followed by ``t``, then ``-1``. Anything else raises
    :class:`KernelBoundsError` naming the first bad row.
    """
    if paths.dtype != torch.int32 or tuple(paths.shape) != (T, T):
        raise KernelBoundsError(
            f"'paths' must be an int32 [T, T] table with T={T} "
            f"(got {paths.dtype}, shape {tuple(paths.shape)})"
        )
    rows = paths.cpu().tolist()
    depth: list[int] = []
    for t, row in enumerate(rows):
        d = sum(1 for s in row if s != -1) - 1
        parent = row[d - 1] if d >= 1 else -1
        expected = [0] if t == 0 else (
            [*rows[parent][:d], t] if 0 <= parent < t and depth[parent] == d - 1 else None
        )
        if d < 0 or expected is None or row != expected + [-1] * (T - d - 1):
            shown = row[: min(max(d + 2, 2), 16)]
            raise KernelBoundsError(
                f"'paths' row {t} must be a root-to-node path of increasing slots from 0 "
                f"to {t} (its parent's row plus {t}), then -1 "
                f"(got {str(shown)[:-1]}{', ...' if len(shown) < T else ''}])"
            )
        depth.append(d)
    # token t's tap j reads entry depth(t) + j of concat(conv_rows, x[path_t]).
    taps = [[i if i < Kc - 1 else Kc - 1 + rows[t][i - (Kc - 1)]
             for i in range(depth[t], depth[t] + Kc)] for t in range(T)]
    return torch.tensor(taps, dtype=torch.int64)
