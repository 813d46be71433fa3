"""Public entry point: an activation times a tensor in one launch — SwiGLU's
``silu(gate) · up`` and the attention output's ``x · sigmoid(gate)``."""

from __future__ import annotations

from typing import Literal

import torch

from dflash.errors import KernelBoundsError
from dflash.kernels import checks
from dflash.kernels.pointwise_reference import act_mul_reference

Activation = Literal["silu", "sigmoid"]
ACTIVATIONS: tuple[Activation, ...] = ("silu", "sigmoid")


def act_mul(
    gate: torch.Tensor,
    x: torch.Tensor,
    act: Activation,
    *,
    out: torch.Tensor | None = None,
    backend: checks.Backend = "auto",
) -> torch.Tensor:
    """``act(gate) · x`` element by element, ``act(gate)`` rounded to x's dtype before the
    product (as the activation's own launch rounds it): one launch instead of two, and no
    copy of a strided ``gate`` or ``x`` whose leading dimensions collapse into one row
    stride (a column slice of a wider buffer is read in place; others are copied).

    A row's result depends on that row alone (M-invariant).

    Args:
        gate, x: ``[..., N]`` floating tensors of one shape and dtype.
        act: ``"silu"`` or ``"sigmoid"``.
        out: ``None`` or a contiguous tensor shaped and typed like ``x``, sharing no
            memory with ``gate`` or ``x``.
        backend: ``"auto"``, ``"triton"`` or ``"reference"`` (see ``gdn_verify``).

    Returns:
        ``act(gate) · x``, contiguous, shaped and typed like ``x`` (``out`` when given).

    Raises:
        TypeError: an argument is not a tensor.
        KernelBoundsError: a shape, dtype, device or ``act`` is wrong (a
            ``ValueError``).
    """
    x = checks.rows("x", x)
    N = x.shape[-1]
    gate = checks.tensor("gate", gate, x.ndim)
    checks.shape("gate", gate, tuple(x.shape), "x's shape")
    checks.dtype("gate", gate, x.dtype)
    if act not in ACTIVATIONS:
        raise KernelBoundsError(f"'act' must be one of {', '.join(ACTIVATIONS)} (got {act!r})")
    inputs: dict[str, torch.Tensor | None] = {"gate": gate, "x": x}
    if out is not None:
        out = checks.output("out", out, tuple(x.shape), x.dtype, "x's shape")
        checks.disjoint("out", out, inputs)
    device = checks.same_device({**inputs, "out": out})
    if N and checks.use_triton(backend, device):
        if x.dtype == torch.float64:
            raise KernelBoundsError("'x' must be float16, bfloat16 or float32 for Triton")
        from dflash.kernels.pointwise_triton import launch_act_mul

        return launch_act_mul(gate, x, act, out)
    return act_mul_reference(gate, x, act, out=out)
