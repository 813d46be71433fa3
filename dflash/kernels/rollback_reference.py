"""Rollback restore as plain torch copies (the reference), and the slot-remap views."""

from __future__ import annotations

import torch


def rollback_restore_reference(
    states: torch.Tensor,       # [L, B, HV, K, V] f32
    conv_rows: torch.Tensor,    # [L, B, Kc-1, C]
    checkpoints: torch.Tensor,  # [L, B, S, HV, K, V] f32
    captured: torch.Tensor,     # [L, B, Kc-1+S, C]
    commit_n: int | torch.Tensor,
    *,
    rows_only: bool = False,
) -> None:
    """Reference twin of :func:`dflash.kernels.rollback_restore` (no bounds checks; a
    device ``commit_n`` is read here and clamped like the kernel clamps it)."""
    Kc1 = conv_rows.shape[2]
    S = checkpoints.shape[2]
    n = commit_n if isinstance(commit_n, int) else min(max(int(commit_n.reshape(())), 1), S)
    if not rows_only:
        states.copy_(checkpoints[:, :, n - 1])
    conv_rows.copy_(captured[:, :, n : n + Kc1])
