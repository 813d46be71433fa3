"""Public entry point: depthwise causal conv1d that captures its input rows."""

from __future__ import annotations

import torch

from dflash.errors import KernelBoundsError
from dflash.kernels import checks
from dflash.kernels.conv_reference import causal_conv1d_capture_reference


def causal_conv1d_capture(
    x: torch.Tensor,
    conv_rows: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    captured: torch.Tensor,
    *,
    activation: str | None = "silu",
    out: torch.Tensor | None = None,
    paths: torch.Tensor | None = None,
    advance_rows: bool = False,
    backend: checks.Backend = "auto",
) -> torch.Tensor:
    """Causal depthwise conv1d over ``T`` tokens, capturing ``concat(conv_rows, x)``.

    Without ``paths`` the tokens are a chain: token ``t`` convolves the ``Kc-1`` rows
    before it in ``concat(conv_rows, x)``. With ``paths`` they are the nodes of a draft
    tree: token ``t`` convolves the end of ``concat(conv_rows, x[path_t])``, ``path_t``
    being its root-to-node slots, so its window holds its nearest ancestors and then, when
    ``depth(t) < Kc-1``, the newest rows of ``conv_rows``: bit for bit the chain result
    over ``x[path_t]`` (the window plain decoding along that path would see).

    Args:
        x: ``[B, T, C]`` new inputs.
        conv_rows: ``[B, Kc-1, C]`` the previous ``Kc-1`` inputs, oldest first; any strided
            view, including a view of ``captured`` itself (slot remap). Same dtype as ``x``.
        weight: ``[C, Kc]``; ``weight[:, Kc-1]`` multiplies the newest input.
        bias: ``[C]`` or ``None``.
        captured: ``[B, Kc-1+S, C]`` with ``S >= T``, same dtype as ``x``, contiguous along
            ``C``; rows ``0 .. Kc-2+T`` receive ``concat(conv_rows, x)``. The window after
            accepting ``n`` tokens is ``captured[:, n : n+Kc-1]``.
        activation: ``"silu"`` or ``None``.
        out: ``None`` (allocated) or a contiguous ``[B, T, C]`` tensor in x's dtype on the
            inputs' device, sharing no memory with any other argument; receives ``y``.
        paths: ``None`` (a chain) or the int32 ``[T, T]`` table of
            :func:`~dflash.kernels.tree_paths` on the inputs' device (any strides; needs
            ``B == 1``). Triton never reads it on the host (CUDA-graph capturable; a
            malformed table gives unspecified rows but every read stays in bounds); the
            reference validates its contents. ``captured`` is filled by slot either way.
        advance_rows: ``True`` to leave in ``conv_rows`` the window after all ``T``
            tokens (``captured[:, T : T+Kc-1]``) as the same call's last step — what a
            decode or prefill that keeps its tokens does next, without a launch of its own.
            A chain only; ``conv_rows`` must then share no memory with ``captured``.
        backend: ``"auto"``, ``"triton"`` or ``"reference"`` (see ``gdn_verify``).

    Returns:
        y: ``[B, T, C]`` in x's dtype (``out`` when given).

    Raises:
        TypeError: an argument is not a tensor.
        KernelBoundsError: shapes, dtypes, devices, ``activation``, ``out`` or ``paths``
            (dtype, shape, device, ``B > 1``; contents on the reference backend) are
            wrong, or ``T > S`` (a ``ValueError``).
    """
    x = checks.tensor("x", x, 3)
    B, T, C = x.shape
    if T < 1:
        raise KernelBoundsError(f"'x' must hold at least one token (got T={T})")
    weight = checks.tensor("weight", weight, 2)
    Kc = weight.shape[1]
    checks.shape("weight", weight, (C, Kc), "[C, Kc] with C from x")
    if Kc < 2:
        raise KernelBoundsError(f"'weight' kernel size Kc must be >= 2 (got {Kc})")
    conv_rows = checks.tensor("conv_rows", conv_rows, 3)
    checks.shape("conv_rows", conv_rows, (B, Kc - 1, C), "[B, Kc-1, C]")
    checks.dtype("conv_rows", conv_rows, x.dtype)
    if bias is not None:
        bias = checks.tensor("bias", bias, 1)
        checks.shape("bias", bias, (C,), "[C]")
    captured = checks.tensor("captured", captured, 3)
    rows = captured.shape[1]
    checks.shape("captured", captured, (B, rows, C), "[B, Kc-1+S, C]")
    checks.dtype("captured", captured, x.dtype)
    if rows - (Kc - 1) < T:
        raise KernelBoundsError(
            f"'captured' needs Kc-1+T={Kc - 1 + T} rows for T={T} tokens (got {rows})"
        )
    if C > 1 and captured.stride(2) != 1:
        raise KernelBoundsError(
            f"'captured' must be contiguous along channels (got strides {captured.stride()})"
        )
    if activation not in ("silu", None):
        raise KernelBoundsError(f"'activation' must be 'silu' or None (got {activation!r})")
    if paths is not None:
        paths = _checked_paths(paths, B, T)
    if not isinstance(advance_rows, bool):
        raise TypeError(f"'advance_rows' must be a bool (got {advance_rows!r})")
    if advance_rows and paths is not None:
        raise KernelBoundsError(
            "'advance_rows' needs a chain: a tree's window follows the path it accepts"
        )
    if advance_rows:
        checks.disjoint("conv_rows", conv_rows, {"captured": captured})
    inputs: dict[str, torch.Tensor | None] = {
        "x": x, "conv_rows": conv_rows, "weight": weight, "bias": bias, "captured": captured,
        "paths": paths,
    }
    if out is not None:
        out = checks.output("out", out, (B, T, C), x.dtype, "x.shape [B, T, C]")
        checks.disjoint("out", out, inputs)
    device = checks.same_device({**inputs, "out": out})
    if paths is not None:
        checks.disjoint("captured", captured, {"paths": paths})

    if not checks.use_triton(backend, device):
        return causal_conv1d_capture_reference(
            x, conv_rows, weight, bias, captured, activation=activation, out=out, paths=paths,
            advance_rows=advance_rows,
        )
    from dflash.kernels.conv_triton import launch_causal_conv1d_capture

    return launch_causal_conv1d_capture(
        x, conv_rows, weight, bias, captured, activation=activation, out=out, paths=paths,
        advance_rows=advance_rows,
    )


def _checked_paths(paths: object, B: int, T: int) -> torch.Tensor:
    """The ``paths`` table's type, dtype, shape and batch rule (never its contents)."""
    if not isinstance(paths, torch.Tensor):
        raise TypeError(f"'paths' must be a torch.Tensor or None (got {type(paths).__name__})")
    if paths.dtype != torch.int32:
        raise KernelBoundsError(f"'paths' must be torch.int32 (got {paths.dtype})")
    checks.shape("paths", paths, (T, T), "[T, T] with T from x")
    if B != 1:
        raise KernelBoundsError(
            f"'paths' needs batch size B=1 (one draft tree per call; got B={B})"
        )
    return paths
