"""Torch reference of :func:`dflash.kernels.act_mul`: the activation's launch, then the
product's (each rounded to the inputs' dtype)."""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F


def act_mul_reference(
    gate: torch.Tensor,
    x: torch.Tensor,
    act: Literal["silu", "sigmoid"],
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``act(gate) * x`` (``F.silu`` or ``torch.sigmoid``), contiguous like ``x``."""
    a = F.silu(gate) if act == "silu" else torch.sigmoid(gate)
    y = a * x
    if out is None:
        return y.contiguous()
    out.copy_(y)
    return out
