"""Public entry point: the M-invariant float8 weight-only linear, and its block quantizer.

Fine-grained float8 checkpoints store a linear's weight as ``weight [N, K]`` in
``torch.float8_e4m3fn`` beside ``weight_scale_inv [ceil(N/bn), ceil(K/bk)]`` float32, one
scale per ``bn × bk`` block (128 × 128 in the published checkpoints; the last blocks
may be partial). The real weight is ``weight[n, k].float() * scale_inv[n // bn, k // bk]``.
Activations stay in their own dtype (weight-only quantization): the weight is read as
one byte per element and dequantized inside the kernel.

- :func:`fp8_linear`: ``x @ dequant(weight).T + bias`` whose output rows do not depend on
  the number of rows;
- :func:`quantize_fp8`: a float weight to ``(weight_fp8, scale_inv)`` by per-block absmax;
- :func:`dequantize_fp8`: back to a float weight.
"""

from __future__ import annotations

import torch

from dflash.errors import KernelBoundsError
from dflash.kernels import checks
from dflash.kernels.fp8_linear_reference import fp8_linear_reference

#: the weights' storage dtype
FP8_DTYPE = torch.float8_e4m3fn
#: the largest finite float8 e4m3 magnitude: a block's absmax maps onto it
FP8_MAX = 448.0
#: the checkpoints' scale block ``(bn, bk)``
DEFAULT_BLOCK = (128, 128)
#: dtypes the Triton kernel accepts for x (the reference also takes float64).
TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _block(value: object) -> tuple[int, int]:
    """``value`` as a ``(bn, bk)`` pair of positive ints, else raise naming ``block``."""
    if (
        not isinstance(value, (tuple, list))
        or len(value) != 2
        or not all(isinstance(v, int) and not isinstance(v, bool) for v in value)
    ):
        raise TypeError(f"'block' must be a pair of ints (bn, bk) (got {value!r})")
    bn, bk = value
    if bn < 1 or bk < 1:
        raise KernelBoundsError(f"'block' sizes must be >= 1 (got {tuple(value)})")
    return bn, bk


def _scale_shape(N: int, K: int, block: tuple[int, int]) -> tuple[int, int]:
    return -(-N // block[0]), -(-K // block[1])


def _fp8_weight(name: str, value: object) -> torch.Tensor:
    """``value`` if it is a 2-D float8 e4m3 tensor with N, K >= 1, contiguous along K."""
    weight = checks.tensor_of(name, value, 2, FP8_DTYPE)
    if weight.shape[0] < 1 or weight.shape[1] < 1:
        raise KernelBoundsError(
            f"'{name}' must have N >= 1 rows and K >= 1 columns (got shape "
            f"{tuple(weight.shape)})"
        )
    if weight.stride(1) != 1 and weight.shape[1] > 1:
        raise KernelBoundsError(
            f"'{name}' must be contiguous along K (got strides {weight.stride()})"
        )
    return weight


def _scales(value: object, N: int, K: int, block: tuple[int, int]) -> torch.Tensor:
    scale_inv = checks.tensor_of("scale_inv", value, 2, torch.float32)
    checks.shape("scale_inv", scale_inv, _scale_shape(N, K, block),
                 f"[ceil(N/bn), ceil(K/bk)] with N={N}, K={K}, block={block}")
    return scale_inv


def _per_element(scale: torch.Tensor, block: tuple[int, int], N: int, K: int) -> torch.Tensor:
    """``[NB, KB]`` block scales spread to ``[N, K]`` (one per weight element)."""
    bn, bk = block
    return scale.repeat_interleave(bn, dim=0)[:N].repeat_interleave(bk, dim=1)[:, :K]


def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale_inv: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    block: tuple[int, int] = DEFAULT_BLOCK,
    out: torch.Tensor | None = None,
    backend: checks.Backend = "auto",
) -> torch.Tensor:
    """``x @ dequant(weight).T (+ bias)`` on a block-scaled float8 weight, whose output
    rows do not depend on the number of rows.

    ``y[..., n] = sum_j (sum_{k in block j} x[..., k] * weight[n, k]) *
    scale_inv[n // bn, j] (+ bias[n])``: each K block ``j`` (``bk`` columns, the last one
    possibly partial) is summed on the raw e4m3 values (exact in every compute dtype)
    from zero, scaled by its ``(n block, k block)`` scale and added to the running sum,
    blocks in ascending order; in float32 (float64 for float64 x on the reference),
    rounded once to x's dtype. Row ``m`` of the result is bitwise identical whatever
    ``M`` (the number of rows in the call) is and whatever the other rows hold, on each
    backend: the Triton kernel reduces every row in one fixed order (fixed 16-row tiles,
    one K block per step, a split-K count chosen from ``(N, K, block)`` only, partial
    sums combined in split order without atomics; see
    :mod:`dflash.kernels.fp8_linear_triton`), the reference runs one matrix-vector
    product per row and K block (:mod:`dflash.kernels.fp8_linear_reference`). The two
    backends agree closely, not bitwise.

    Args:
        x: ``[..., K]`` float16/bfloat16/float32 (float64 on the reference); ``M`` is the
            product of the leading dimensions (0 rows is allowed).
        weight: ``[N, K]`` ``torch.float8_e4m3fn``, contiguous along K.
        scale_inv: ``[ceil(N/bn), ceil(K/bk)]`` float32, the dequantization scale of each
            block (any strides).
        bias: ``None`` or ``[N]`` in x's dtype.
        block: ``(bn, bk)``, the scale block (positive ints). Triton needs ``bk`` a
            multiple of 16 in 16 … 128 (any ``bn``).
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
        TypeError: ``x``, ``weight``, ``scale_inv``, ``bias`` or ``out`` is not a tensor,
            or ``block`` is not a pair of ints.
        ValueError: (:class:`~dflash.errors.KernelBoundsError`) shapes, dtypes, devices,
            strides or block sizes are wrong, or ``backend`` is unknown.
    """
    x = checks.rows("x", x)
    K = x.shape[-1]
    if K < 1:
        raise KernelBoundsError(f"'x' last dimension K must be >= 1 (got {K})")
    blk = _block(block)
    weight = _fp8_weight("weight", weight)
    N = weight.shape[0]
    checks.shape("weight", weight, (N, K), "[N, K] with K from x")
    scale_inv = _scales(scale_inv, N, K, blk)
    if bias is not None:
        bias = checks.tensor("bias", bias, 1)
        checks.shape("bias", bias, (N,), "[N] with N from weight")
        checks.dtype("bias", bias, x.dtype)
    if out is not None:
        out = checks.tensor("out", out, x.ndim)
        checks.shape("out", out, (*x.shape[:-1], N), "[..., N] with x's leading shape")
        checks.dtype("out", out, x.dtype)
        checks.rows_view("out", out, N)
    device = checks.same_device(
        {"x": x, "weight": weight, "scale_inv": scale_inv, "bias": bias, "out": out}
    )
    if not checks.use_triton(backend, device):
        return fp8_linear_reference(x, weight, scale_inv, bias, block=blk, out=out)
    if x.dtype not in TRITON_DTYPES:
        raise KernelBoundsError(
            f"'x' dtype must be float16, bfloat16 or float32 for Triton (got {x.dtype})"
        )
    if blk[1] % 16 or blk[1] > 128:
        raise KernelBoundsError(
            f"'block' bk must be a multiple of 16 in 16 … 128 for Triton (got {blk})"
        )
    from dflash.kernels.fp8_linear_triton import launch_fp8_linear

    return launch_fp8_linear(x, weight, scale_inv, bias, blk, out)


def quantize_fp8(
    weight: torch.Tensor, block: tuple[int, int] = DEFAULT_BLOCK
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a float ``[N, K]`` weight to float8 e4m3 with one scale per block.

    Per ``bn × bk`` block (the last ones partial): ``scale_inv = amax / 448`` with
    ``amax`` the block's largest ``|w|`` in float32 (a scale that would be 0, an all-zero
    block, is 1), and ``q = (w / scale_inv).clamp(-448, 448).to(float8_e4m3fn)`` (round
    to nearest even). The block's largest magnitude maps onto ±448; the clamp catches a
    quotient that the division rounds just past it.

    Args:
        weight: ``[N, K]`` float16/bfloat16/float32/float64, finite, ``N, K >= 1``.
        block: ``(bn, bk)`` positive ints.

    Returns:
        ``(weight_fp8 [N, K] float8_e4m3fn, scale_inv [ceil(N/bn), ceil(K/bk)] float32)``,
        contiguous, on weight's device.

    Raises:
        TypeError: ``weight`` is not a tensor or ``block`` not a pair of ints.
        ValueError: (:class:`~dflash.errors.KernelBoundsError`) weight is not a finite
            2-D floating tensor with ``N, K >= 1``, or a block size is below 1.
    """
    w = checks.tensor("weight", weight, 2)
    blk = _block(block)
    N, K = w.shape
    if N < 1 or K < 1:
        raise KernelBoundsError(
            f"'weight' must have N >= 1 rows and K >= 1 columns (got shape {tuple(w.shape)})"
        )
    if not bool(torch.isfinite(w).all()):
        raise KernelBoundsError("'weight' must be finite (got inf or NaN entries)")
    wf = w.to(torch.float32)
    NB, KB = _scale_shape(N, K, blk)
    padded = torch.zeros(NB * blk[0], KB * blk[1], dtype=torch.float32, device=w.device)
    padded[:N, :K] = wf.abs()
    amax = padded.view(NB, blk[0], KB, blk[1]).amax(dim=(1, 3))       # [NB, KB]
    scale = amax / FP8_MAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = (wf / _per_element(scale, blk, N, K)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.contiguous(), scale.contiguous()


def dequantize_fp8(
    weight_fp8: torch.Tensor,
    scale_inv: torch.Tensor,
    block: tuple[int, int] = DEFAULT_BLOCK,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """The real weight ``weight_fp8[n, k] * scale_inv[n // bn, k // bk]`` in ``dtype``.

    The product is formed in float32 (float64 for ``dtype=torch.float64``: exact) and
    rounded once to ``dtype``.

    Args:
        weight_fp8: ``[N, K]`` ``torch.float8_e4m3fn``.
        scale_inv: ``[ceil(N/bn), ceil(K/bk)]`` float32.
        block: ``(bn, bk)`` positive ints.
        dtype: float16/bfloat16/float32/float64.

    Returns:
        A new ``[N, K]`` tensor of ``dtype`` on weight's device.

    Raises:
        TypeError: a tensor argument is not a tensor, ``block`` not a pair of ints or
            ``dtype`` not a ``torch.dtype``.
        ValueError: (:class:`~dflash.errors.KernelBoundsError`) shapes, dtypes or devices
            are wrong.
    """
    blk = _block(block)
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"'dtype' must be a torch.dtype (got {type(dtype).__name__})")
    if dtype not in checks.FLOAT_DTYPES:
        raise KernelBoundsError(
            f"'dtype' must be float16, bfloat16, float32 or float64 (got {dtype})"
        )
    w = _fp8_weight("weight_fp8", weight_fp8)
    N, K = w.shape
    scale = _scales(scale_inv, N, K, blk)
    checks.same_device({"weight_fp8": w, "scale_inv": scale})
    work = torch.float64 if dtype == torch.float64 else torch.float32
    full = w.to(work) * _per_element(scale.to(work), blk, N, K)
    return full.to(dtype)
