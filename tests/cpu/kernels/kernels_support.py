"""Shared inputs and comparisons for the kernel tests."""

from __future__ import annotations

import pytest
import torch

from dflash.kernels import checks

NAN = float("nan")

#: Triton kernels run on CPU only under the interpreter (scripts/test.sh sets it).
needs_interpreter = pytest.mark.skipif(
    not checks.INTERPRET, reason="Triton on CPU needs TRITON_INTERPRET=1 at import"
)


def rel_rms(got: torch.Tensor, ref: torch.Tensor) -> float:
    """||got - ref|| / ||ref|| in float64; NaN anywhere in ``got`` gives inf."""
    g, r = got.double(), ref.double()
    if not torch.isfinite(g).all():
        return float("inf")
    return float((g - r).norm() / r.norm().clamp_min(1e-30))


def gdn_inputs(
    B: int, T: int, HK: int, HV: int, K: int, V: int, dtype: torch.dtype, seed: int
) -> dict[str, torch.Tensor]:
    """Random gated-delta-rule inputs in the ranges a real model produces."""
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen)

    return {
        "q": rnd(B, T, HK, K).to(dtype),
        "k": rnd(B, T, HK, K).to(dtype),
        "v": rnd(B, T, HV, V).to(dtype),
        "g": torch.nn.functional.logsigmoid(rnd(B, T, HV) + 2.0),  # decay in (0, 1)
        "beta": torch.sigmoid(rnd(B, T, HV)),
        "initial_state": rnd(B, HV, K, V) * 0.5,
    }


def as64(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: t.double() for n, t in inputs.items()}


def nan_slots(B: int, S: int, HV: int, K: int, V: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.full((B, S, HV, K, V), NAN, dtype=dtype)
