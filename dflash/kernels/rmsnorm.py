"""Public entry points: RMSNorm (zero-centred or gated) in one launch, and its two fused
forms — fed by the residual stream's add (:func:`add_rms_norm`), and followed by the
rotary embedding (:func:`rms_norm_rotary`)."""

from __future__ import annotations

import math

import torch

from dflash.errors import KernelBoundsError
from dflash.kernels import checks
from dflash.kernels.rmsnorm_reference import (
    add_rms_norm_reference,
    rms_norm_reference,
    rms_norm_rotary_reference,
)

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
    x, weight = _check_norm(x, weight, eps)
    if gate is not None:
        gate = checks.tensor("gate", gate, x.ndim)
        checks.shape("gate", gate, tuple(x.shape), "x's shape")
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


def add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    *,
    zero_centred: bool = True,
    out: torch.Tensor | None = None,
    sum_out: torch.Tensor | None = None,
    backend: checks.Backend = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual stream's add and the next norm in one launch: ``s = residual + x``
    (rounded to x's dtype, as one add rounds it), then ``(rms_norm(s), s)``.

    Args:
        x, residual: ``[..., D]`` floating tensors of one shape and dtype.
        weight, eps, zero_centred, backend: as :func:`rms_norm`.
        out, sum_out: ``None`` (allocated) or contiguous tensors shaped and typed like
            ``x``, sharing no memory with any other argument; receive ``y`` and ``s``.

    Returns:
        ``(y, s)``, both shaped and typed like ``x``: the same bits as ``s = residual +
        x`` followed by :func:`rms_norm` of ``s``.

    Raises:
        TypeError, KernelBoundsError: as :func:`rms_norm`; ``residual`` or ``sum_out``
            unlike ``x``.
    """
    x, weight = _check_norm(x, weight, eps)
    residual = checks.tensor("residual", residual, x.ndim)
    checks.shape("residual", residual, tuple(x.shape), "x's shape")
    if residual.dtype != x.dtype:
        raise KernelBoundsError(
            f"'residual' must be {x.dtype} like 'x' (got {residual.dtype})"
        )
    inputs: dict[str, torch.Tensor | None] = {"x": x, "residual": residual, "weight": weight}
    if out is not None:
        out = checks.output("out", out, tuple(x.shape), x.dtype, "x's shape")
        checks.disjoint("out", out, inputs)
    if sum_out is not None:
        sum_out = checks.output("sum_out", sum_out, tuple(x.shape), x.dtype, "x's shape")
        checks.disjoint("sum_out", sum_out, {**inputs, "out": out})
    device = checks.same_device({**inputs, "out": out, "sum_out": sum_out})
    if checks.use_triton(backend, device):
        from dflash.kernels.rmsnorm_triton import launch_rms_norm

        s = torch.empty_like(x, memory_format=torch.contiguous_format) if sum_out is None \
            else sum_out
        y = launch_rms_norm(x, weight, float(eps), zero_centred, None, out=out,
                            residual=residual.contiguous(), sum_out=s)
        return y, s
    return add_rms_norm_reference(x, residual, weight, float(eps), zero_centred=zero_centred,
                                  out=out, sum_out=sum_out)


def rms_norm_rotary(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    backend: checks.Backend = "auto",
) -> torch.Tensor:
    """A head's zero-centred RMSNorm and the rotary embedding in one launch: each row of
    ``x: [..., T, H, D]`` normalised, then its first ``RD`` channels rotated in
    rotate-half form by its token's ``cos``/``sin`` (the same bits as the norm followed
    by the rotation's separate launches, for 16-bit ``x``). ``x`` may be a strided view
    (a head's query inside ``[query | gate]``): it is read in place when its leading
    dimensions collapse into one row stride.

    Args:
        x: ``[..., T, H, D]`` floating tensor, last dimension contiguous, ``D <= 8192``.
        weight, eps, backend: as :func:`rms_norm`.
        cos, sin: ``[T, RD]`` in x's dtype, ``RD`` even, ``2 <= RD <= D``.
        out: ``None`` or a contiguous tensor shaped and typed like ``x``.

    Returns:
        ``[..., T, H, D]`` like ``x``, contiguous (``out`` when given).

    Raises:
        TypeError, KernelBoundsError: as :func:`rms_norm`; ``cos``/``sin`` of the wrong
            shape or dtype, ``x`` of rank below 3.
    """
    x, weight = _check_norm(x, weight, eps)
    if x.ndim < 3:
        raise KernelBoundsError(f"'x' must be [..., T, H, D] (got {tuple(x.shape)})")
    T, D = x.shape[-3], x.shape[-1]
    cos = checks.tensor("cos", cos, 2)
    sin = checks.tensor("sin", sin, 2)
    rd = cos.shape[1]
    if cos.shape[0] != T or rd % 2 or not 2 <= rd <= D:
        raise KernelBoundsError(
            f"'cos' must be [T, RD] with T = {T} from x and an even RD in [2, {D}] "
            f"(got {tuple(cos.shape)})"
        )
    checks.shape("sin", sin, tuple(cos.shape), "cos's shape")
    for name, t in (("cos", cos), ("sin", sin)):
        if t.dtype != x.dtype:
            raise KernelBoundsError(f"'{name}' must be {x.dtype} like 'x' (got {t.dtype})")
    inputs: dict[str, torch.Tensor | None] = {"x": x, "weight": weight, "cos": cos, "sin": sin}
    if out is not None:
        out = checks.output("out", out, tuple(x.shape), x.dtype, "x's shape")
        checks.disjoint("out", out, inputs)
    device = checks.same_device({**inputs, "out": out})
    if checks.use_triton(backend, device):
        from dflash.kernels.rmsnorm_triton import launch_rms_norm

        # a strided x is read in place, or copied once when it cannot be (as_rows)
        return launch_rms_norm(x, weight, float(eps), True, None, out=out,
                               rotary=(cos.contiguous(), sin.contiguous(), x.shape[-2]))
    return rms_norm_rotary_reference(x, weight, float(eps), cos, sin, out=out)


def _check_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` rows of ``1 … MAX_DIM`` channels, ``weight: [D]``, a positive finite ``eps``."""
    x = checks.rows("x", x)
    D = x.shape[-1]
    if not 1 <= D <= MAX_DIM:
        raise KernelBoundsError(f"'x' last dimension must be in [1, {MAX_DIM}] (got {D})")
    weight = checks.tensor("weight", weight, 1)
    checks.shape("weight", weight, (D,), "[D] with D from x")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not (
        math.isfinite(eps) and eps > 0
    ):
        raise KernelBoundsError(f"'eps' must be a positive finite float (got {eps!r})")
    return x, weight
