"""Torch reference of the fused RMSNorm kernel (same signature as :func:`rms_norm`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    *,
    zero_centred: bool,
    gate: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """RMSNorm over the last dimension of ``x``, in float32, returned in x's dtype.

    ``zero_centred=True`` (Qwen3.5 block norms): ``x / rms(x) * (1 + weight)``.
    ``zero_centred=False`` with ``gate`` (Gated DeltaNet output norm):
    ``(weight * (x / rms(x)).to(dtype)) * silu(gate)``; without ``gate``:
    ``weight * (x / rms(x)).to(dtype)``. ``out`` (shaped and typed like ``x``) receives
    the result when given.
    """
    dtype = x.dtype
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    y = (
        (normed * (1.0 + weight.float())).to(dtype)
        if zero_centred
        else weight * normed.to(dtype)
    )
    if gate is not None:
        y = (y * F.silu(gate.float())).to(dtype)
    if out is None:
        return y
    out.copy_(y)
    return out
