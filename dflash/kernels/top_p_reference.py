"""Torch reference of the top-p (nucleus) cut (same signature as :func:`top_p_count`).

For a row ``s`` of temperature-scaled logits sorted in descending order (``s_0`` finite,
``-inf`` allowed at the tail), ``p_j = exp(s_j - s_0) / Z`` with ``Z = sum_j exp(s_j - s_0)``
and ``before_j = p_0 + ... + p_{j-1}`` (the exclusive prefix sum, ``before_0 = 0``). The
result is the number of leading entries with ``before_j < top_p``: the length of the kept
prefix, at least 1. Everything is float32, ``top_p`` rounded to float32 first.
"""

from __future__ import annotations

import torch


def top_p_count_reference(
    sorted_scores: torch.Tensor, top_p: float, *, out: torch.Tensor | None = None
) -> torch.Tensor:
    """``n_keep: [T]`` int64 for ``sorted_scores: [T, V]`` float32 (rows sorted descending).

    One row at a time, so a row's sums never depend on the others. ``out`` (``[T]`` int64)
    receives the counts when given. No value is read back to the host.
    """
    T = sorted_scores.shape[0]
    n_keep = (
        torch.empty(T, dtype=torch.int64, device=sorted_scores.device) if out is None else out
    )
    threshold = torch.tensor(top_p, dtype=torch.float32, device=sorted_scores.device)
    for i in range(T):
        row = sorted_scores[i].to(torch.float32)  # [V], descending
        e = torch.exp(row - row[0])  # -inf entries give 0
        p = e / e.sum()
        before = torch.cat((p.new_zeros(1), torch.cumsum(p, 0)[:-1]))  # exclusive prefix
        keep = before < threshold
        keep[0] = True  # before_0 = 0 < top_p, even when top_p rounds to 0 in float32
        n_keep[i] = keep.to(torch.int64).cumprod(0).sum()  # the length of the kept prefix
    return n_keep
