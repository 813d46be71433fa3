"""Public entry point: RMSNorm (zero-centred or gated) in one launch."""

from __future__ import annotations

import math

import torch

from dflash.errors import KernelBoundsError
from dflash.kernels import checks
from dflash.kernels.rmsnorm_reference import rms_norm_reference

MAX_DIM = 8192


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    *,
    zero_centred: bool,
    gate: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    backend: checks.Backend = "auto",
) -> torch.Tensor:
    """RMSNorm over the last dimension, computed in float32, returned in x's dtype.

    Args:
        x: ``[..., D]`` floating tensor, ``1 <= D <= 8192``.
        weight: ``[D]``.
        eps: positive finite float added to the mean square.
        zero_centred: ``True``: ``x / rms(x) * (1 + weight)`` (Qwen3.5 block norms);
            ``False``: ``weight * (x / rms(x))`` (Gated DeltaNet output norm).
        gate: ``None`` or a tensor shaped like ``x``; the result is multiplied by
            ``silu(gate)``.
        out: ``None`` (allocated) or a contiguous tensor shaped and typed like ``x`` on
            x's device, sharing no memory with any other argument; receives ``y``.
        backend: ``"auto"``, ``"triton"`` or ``"reference"`` (see ``gdn_verify``).

    Returns:
        ``y`` shaped and typed like ``x`` (``out`` when given).

    Raises:
        TypeError: an argument is not a tensor.
        KernelBoundsError: shapes, dtypes, devices, ``eps`` or ``out`` are wrong (a
            ``ValueError``).
    """
    x = checks.rows("x", x)
    D = x.shape[-1]
    if not 1 <= D <= MAX_DIM:
        raise KernelBoundsError(f"'x' last dimension must be in [1, {MAX_DIM}] (got {D})")
    weight = checks.tensor("weight", weight, 1)
    checks.shape("weight", weight, (D,), "[D] with D from x")
    if gate is not None:
        gate = checks.tensor("gate", gate, x.ndim)
        checks.shape("gate", gate, tuple(x.shape), "x's shape")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not (
        math.isfinite(eps) and eps > 0
    ):
        raise KernelBoundsError(f"'eps' must be a positive finite float (got {eps!r})")
    inputs: dict[str, torch.Tensor | None] = {"x": x, "weight": weight, "gate": gate}
    if out is not None:
        out = checks.output("out", out, tuple(x.shape), x.dtype, "x's shape")
        checks.disjoint("out", out, inputs)
    device = checks.same_device({**inputs, "out": out})
    if checks.use_triton(backend, device):
        from dflash.kernels.rmsnorm_triton import launch_rms_norm

        return launch_rms_norm(x, weight, float(eps), zero_centred, gate, out=out)
    return rms_norm_reference(
        x, weight, float(eps), zero_centred=zero_centred, gate=gate, out=out
    )
