"""Rollback restore as plain torch copies (the reference), and the slot-remap views."""

from __future__ import annotations

import torch


def rollback_restore_reference(
    states: torch.Tensor,       # [L, B, HV, K, V] f32
    conv_rows: torch.Tensor,    # [L, B, Kc-1, C]
    checkpoints: torch.Tensor,  # [L, B, S, HV, K, V] f32
    captured: torch.Tensor,     # [L, B, Kc-1+S, C]
    commit_n: int,
) -> None:
    """Reference twin of :func:`dflash.kernels.rollback_restore` (no bounds checks)."""
    Kc1 = conv_rows.shape[2]
    states.copy_(checkpoints[:, :, commit_n - 1])
    conv_rows.copy_(captured[:, :, commit_n : commit_n + Kc1])
