"""Gated DeltaNet's per-token gates, in torch (the reference).

    beta = sigmoid(b)                                  (in b's dtype)
    g    = -exp(A_log) * softplus(a + dt_bias)         (float32; softplus threshold 20)

exactly the formulation of Qwen3.5's ``Qwen3_5GatedDeltaNet`` (``A_log``, ``dt_bias`` per
value head).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def gdn_gates_reference(
    a: torch.Tensor,        # [..., HV]
    b: torch.Tensor,        # [..., HV]
    A_log: torch.Tensor,    # [HV]
    dt_bias: torch.Tensor,  # [HV]
    *,
    beta_out: torch.Tensor | None = None,  # [..., HV] in b's dtype
    g_out: torch.Tensor | None = None,     # [..., HV] float32 (float64 for float64 a)
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference twin of :func:`dflash.kernels.gdn_gates` (same arguments and results)."""
    acc = torch.float64 if a.dtype == torch.float64 else torch.float32
    beta = torch.sigmoid(b)
    g = -A_log.to(acc).exp() * F.softplus(a.to(acc) + dt_bias.to(acc))
    if beta_out is not None:
        beta = beta_out.copy_(beta)
    if g_out is not None:
        g = g_out.copy_(g)
    return beta, g
