"""Public entry point: the M-invariant linear layer ``x @ weight.T + bias``."""

from __future__ import annotations

import torch

from dflash.kernels import checks
from dflash.kernels.linear_reference import linear_reference

#: dtypes the Triton kernel accepts (the reference also takes float64).
TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,
    backend: checks.Backend = "auto",
) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` whose output rows do not depend on the number of rows.

    Row ``m`` of the result is bitwise identical whatever ``M`` (the number of rows in the
    call) is and whatever the other rows hold, on each backend: the Triton kernel reduces
    every row in one fixed order (fixed tiles, fixed K order, a split-K count chosen from
    ``(N, K)`` only, partial sums combined in split order without atomics), the reference
    runs one matrix-vector product per row. Products accumulate in float32 (float64 for
    float64 inputs on the reference) and are rounded once to x's dtype.

    Args:
        x: ``[..., K]`` float16/bfloat16/float32 (float64 on the reference); ``M`` is the
            product of the leading dimensions (0 rows is allowed).
        weight: ``[N, K]`` in x's dtype, contiguous along K.
        bias: ``None`` or ``[N]`` in x's dtype.
        out: ``None`` (allocated) or ``[..., N]`` with x's leading shape and dtype, on x's
            device; its last dimension must be contiguous and its leading dimensions
            collapsible into one row stride (so a column slice ``buf[:, a:b]`` of a wider
            buffer is accepted). Fully overwritten.
        backend: ``"auto"`` (Triton on CUDA tensors, or on CPU under
            ``TRITON_INTERPRET=1``; the reference otherwise), ``"triton"`` or
            ``"reference"``.

    Returns:
        ``out`` (or a new ``[..., N]`` tensor in x's dtype).

    Raises:
        TypeError: ``x``, ``weight``, ``bias`` or ``out`` is not a tensor.
        ValueError: shapes, dtypes, devices or strides are wrong, or ``backend`` is unknown.
    """
    x = checks.rows("x", x)
    K = x.shape[-1]
    if K < 1:
        raise ValueError(f"'x' last dimension K must be >= 1 (got {K})")
    weight = checks.tensor("weight", weight, 2)
    N = weight.shape[0]
    if N < 1:
        raise ValueError(f"'weight' must have N >= 1 output rows (got shape {tuple(weight.shape)})")
    checks.shape("weight", weight, (N, K), "[N, K] with K from x")
    checks.dtype("weight", weight, x.dtype)
    if weight.stride(1) != 1:
        raise ValueError(
            f"'weight' must be contiguous along K (got strides {weight.stride()})"
        )
    if bias is not None:
        bias = checks.tensor("bias", bias, 1)
        checks.shape("bias", bias, (N,), "[N] with N from weight")
        checks.dtype("bias", bias, x.dtype)
    if out is not None:
        out = checks.tensor("out", out, x.ndim)
        checks.shape("out", out, (*x.shape[:-1], N), "[..., N] with x's leading shape")
        checks.dtype("out", out, x.dtype)
        checks.rows_view("out", out, N)
    device = checks.same_device({"x": x, "weight": weight, "bias": bias, "out": out})
    if not checks.use_triton(backend, device):
        return linear_reference(x, weight, bias, out=out)
    if x.dtype not in TRITON_DTYPES:
        raise ValueError(
            f"'x' dtype must be float16, bfloat16 or float32 for Triton (got {x.dtype})"
        )
    from dflash.kernels.linear_triton import launch_linear

    return launch_linear(x, weight, bias, out)
