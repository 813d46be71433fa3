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


def add_rms_norm_reference(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    *,
    zero_centred: bool,
    out: torch.Tensor | None = None,
    sum_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``s = residual + x`` (one add, in x's dtype), then ``(rms_norm(s), s)``."""
    s = residual + x
    if sum_out is not None:
        sum_out.copy_(s)
        s = sum_out
    return rms_norm_reference(s, weight, eps, zero_centred=zero_centred, out=out), s


def rotary_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The first ``RD`` channels of ``x: [..., T, H, D]`` rotated in rotate-half form by
    ``cos, sin: [T, RD]`` (the same angles for every head), the rest kept: each product
    and the sum one operation, rounded to x's dtype. The model's rotary embedding is this
    formula (:func:`dflash.model.layers.apply_rotary`)."""
    rd = cos.shape[-1]
    half = rd // 2
    c, s = cos[:, None, :], sin[:, None, :]  # over the heads
    rot = x[..., :rd]
    rotated = torch.cat((-rot[..., half:], rot[..., :half]), dim=-1)
    return torch.cat((rot * c + rotated * s, x[..., rd:]), dim=-1)


def rms_norm_rotary_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The zero-centred norm of ``x: [..., T, H, D]``, then :func:`rotary_reference`."""
    result = rotary_reference(rms_norm_reference(x, weight, eps, zero_centred=True), cos, sin)
    if out is None:
        return result
    out.copy_(result)
    return out
