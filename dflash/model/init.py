"""Seeded weights for a :class:`~dflash.model.target.TargetModel` (no files, no network).

Each parameter is drawn in float32 on the target device from one ``torch.Generator``
seeded with ``seed``, in the order of ``named_parameters()``, then cast to ``dtype``:

- linear / conv weights: ``N(0, 1/fan_in)`` (activations keep unit scale through depth);
- embeddings: ``N(0, 1)``;
- zero-centred RMSNorm weights (``1 + w``): ``N(0, 0.1)``; gated-norm weights: ``1 + N(0, 0.1)``;
- ``A_log = log(U(1, 16))``, ``dt_bias = log(expm1(U(0.001, 0.1)))`` (the usual
  Mamba-style time-step range), biases zero.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn


def _draw(name: str, shape: torch.Size, gen: torch.Generator, device: torch.device) -> Tensor:
    def randn(std: float) -> Tensor:
        return torch.randn(shape, generator=gen, device=device, dtype=torch.float32) * std

    def uniform(lo: float, hi: float) -> Tensor:
        return torch.rand(shape, generator=gen, device=device, dtype=torch.float32) * (hi - lo) + lo

    leaf = name.rsplit(".", 1)[-1]
    if leaf == "A_log":
        return uniform(1.0, 16.0).log()
    if leaf == "dt_bias":
        return torch.expm1(uniform(0.001, 0.1)).log()
    if leaf == "bias":
        return torch.zeros(shape, device=device)
    if name.startswith("embed_tokens"):
        return randn(1.0)
    if name.endswith("linear_attn.norm.weight"):
        return 1.0 + randn(0.1)
    if name.endswith("norm.weight"):
        return randn(0.1)
    fan_in = math.prod(shape[1:]) if len(shape) > 1 else shape[0]
    return randn(fan_in**-0.5)


def seeded_parameters(
    model: nn.Module, *, seed: int, dtype: torch.dtype, device: torch.device
) -> dict[str, Tensor]:
    """Fresh tensors for every parameter of ``model`` (a tied LM head is drawn once)."""
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    out: dict[str, Tensor] = {}
    for name, param in model.named_parameters():  # tied parameters are listed once
        out[name] = _draw(name, param.shape, gen, device).to(dtype)
    if "lm_head.weight" not in out:
        out["lm_head.weight"] = out["embed_tokens.weight"]
    return out
