"""Public entry point: Gated DeltaNet's gates ``beta`` and ``g`` in one call."""

from __future__ import annotations

import torch

from dflash.errors import KernelBoundsError
from dflash.kernels import checks
from dflash.kernels.gates_reference import gdn_gates_reference


def gdn_gates(
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    *,
    beta_out: torch.Tensor | None = None,
    g_out: torch.Tensor | None = None,
    backend: checks.Backend = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """``beta = sigmoid(b)`` and ``g = -exp(A_log) · softplus(a + dt_bias)`` per element.

    A row's results depend on that row alone (M-invariant): one launch on Triton, the
    torch formulation of Qwen3.5 on the reference.

    Args:
        a, b: ``[..., HV]`` floating tensors of one shape and dtype, contiguous along the
            last dimension with leading dimensions that collapse into rows (a column slice
            of a wider buffer is accepted).
        A_log, dt_bias: ``[HV]`` floating tensors.
        beta_out: ``None`` or a contiguous ``[..., HV]`` tensor in b's dtype.
        g_out: ``None`` or a contiguous ``[..., HV]`` float32 tensor (float64 when ``a`` is
            float64, reference only).
        backend: ``"auto"``, ``"triton"`` or ``"reference"`` (see ``gdn_verify``).

    Returns:
        ``(beta, g)`` (the ``out`` tensors when given).

    Raises:
        TypeError: an argument is not a tensor.
        KernelBoundsError: shapes, dtypes, devices, strides or outputs are wrong.
    """
    a = checks.rows("a", a)
    HV = a.shape[-1]
    if HV < 1:
        raise KernelBoundsError(f"'a' last dimension HV must be >= 1 (got {HV})")
    b = checks.tensor("b", b, a.ndim)
    checks.shape("b", b, tuple(a.shape), "a's shape")
    checks.dtype("b", b, a.dtype)
    A_log = checks.tensor("A_log", A_log, 1)
    checks.shape("A_log", A_log, (HV,), "[HV] with HV from a")
    dt_bias = checks.tensor("dt_bias", dt_bias, 1)
    checks.shape("dt_bias", dt_bias, (HV,), "[HV] with HV from a")
    checks.rows_view("a", a, HV)
    checks.rows_view("b", b, HV)
    g_dtype = torch.float64 if a.dtype == torch.float64 else torch.float32
    inputs: dict[str, torch.Tensor | None] = {"a": a, "b": b, "A_log": A_log, "dt_bias": dt_bias}
    if beta_out is not None:
        beta_out = checks.output("beta_out", beta_out, tuple(a.shape), b.dtype, "a's shape")
        checks.disjoint("beta_out", beta_out, inputs)
    if g_out is not None:
        g_out = checks.output("g_out", g_out, tuple(a.shape), g_dtype, "a's shape")
        checks.disjoint("g_out", g_out, {**inputs, "beta_out": beta_out})
    device = checks.same_device({**inputs, "beta_out": beta_out, "g_out": g_out})
    if checks.use_triton(backend, device):
        if a.dtype == torch.float64:
            raise KernelBoundsError("'a' must be float16, bfloat16 or float32 for Triton")
        from dflash.kernels.gates_triton import launch_gdn_gates

        return launch_gdn_gates(a, b, A_log, dt_bias, beta_out, g_out)
    return gdn_gates_reference(a, b, A_log, dt_bias, beta_out=beta_out, g_out=g_out)
