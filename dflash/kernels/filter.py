"""Public entry point: the floors of the sampling filters (top-k, top-p, min-p), one per
row, without a host read.

Each filter keeps a prefix of the row's tokens ordered by logit descending, then id; the
floor ``(floor, floor_id)`` is the last kept token's logit and id (the exact definition is
in :mod:`dflash.kernels.filter_reference`). On CUDA, 16-bit logits take the Triton kernels
(a histogram over the 65,536 logit values, no sort of the vocabulary); float32 logits and
the CPU take the torch reference, which sorts. Both compute the same integers.
"""

from __future__ import annotations

import math

import torch

from dflash.errors import KernelBoundsError
from dflash.kernels import checks
from dflash.kernels.filter_reference import filter_floors_reference

#: the widest vocabulary: ids and counts are int32 inside the kernels
MAX_VOCAB = 1 << 30
#: the logit dtypes the Triton kernels take (one histogram bin per 16-bit pattern)
HISTOGRAM_DTYPES = (torch.bfloat16, torch.float16)
#: the widest vocabulary of the Triton kernels (one program sorts 16 maxima per 4,096 tokens)
MAX_TRITON_VOCAB = 1 << 20


def filter_floors(
    logits: torch.Tensor,
    inv_temperature: float,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
    *,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
    backend: checks.Backend = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Row ``i`` keeps token ``v`` when ``l_v > floor[i]``, or ``l_v == floor[i]`` and
    ``v <= floor_id[i]`` (``l = float32(logits) + 0.0``): the shortest of the prefixes the
    filters keep. A row's floor depends on that row alone.

    Args:
        logits: ``[T, V]`` floating tensor, ``T >= 1``, ``1 <= V <= 2**30``.
        inv_temperature: a positive finite float (``1 / temperature``, used as float32):
            top-p's probabilities and min-p's ratio are those of ``softmax(l * it)``.
        top_k: an int ``>= 0``; 0, or ``V`` and more, turns it off.
        top_p: a float in ``(0, 1]``; 1 turns it off.
        min_p: a float in ``[0, 1]``; 0 turns it off.
        out: None, or ``(floor, floor_id)``: contiguous ``[T]`` float32 and int64 tensors
            on the logits' device that receive the floors.
        backend: ``"auto"`` (Triton for 16-bit logits of at most ``2**20`` tokens on
            CUDA when top-k or top-p is on; min-p alone, float32 logits and the CPU take
            the reference), ``"triton"`` (16-bit logits only) or ``"reference"``.

    Returns:
        ``(floor [T] float32, floor_id [T] int64)`` (``out`` when given). With no filter
        on, ``(-inf, V - 1)``: every token kept.

    Raises:
        TypeError: an argument has the wrong type.
        KernelBoundsError: a shape, dtype, device, range or ``out`` is wrong (a
            ``ValueError``), or ``backend="triton"`` with logits that are not 16-bit.
    """
    logits = checks.tensor("logits", logits, 2)
    T, V = logits.shape
    if T < 1 or not 1 <= V <= MAX_VOCAB:
        raise KernelBoundsError(
            f"'logits' must be [T, V] with T >= 1 and 1 <= V <= {MAX_VOCAB} "
            f"(got {tuple(logits.shape)})"
        )
    _check_number("inv_temperature", inv_temperature, 0.0, math.inf, lo_open=True)
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
        raise KernelBoundsError(f"'top_k' must be an int >= 0 (got {top_k!r})")
    _check_number("top_p", top_p, 0.0, 1.0, lo_open=True)
    _check_number("min_p", min_p, 0.0, 1.0, lo_open=False)
    inputs: dict[str, torch.Tensor | None] = {"logits": logits}
    if out is not None:
        if not isinstance(out, tuple) or len(out) != 2:
            raise TypeError(f"'out' must be a (floor, floor_id) tuple or None (got {out!r})")
        floor = checks.output("out[0]", out[0], (T,), torch.float32, "[T] with T from logits")
        floor_id = checks.output("out[1]", out[1], (T,), torch.int64, "[T] with T from logits")
        checks.disjoint("out[0]", floor, {**inputs, "out[1]": floor_id})
        checks.disjoint("out[1]", floor_id, inputs)
        inputs = {**inputs, "out[0]": floor, "out[1]": floor_id}
    device = checks.same_device(inputs)
    it = float(torch.tensor(inv_temperature, dtype=torch.float32))
    if not math.isfinite(it):
        raise KernelBoundsError(
            f"'inv_temperature' must stay finite in float32 (got {inv_temperature!r})"
        )
    ordering = 0 < top_k < V or top_p < 1.0  # min-p alone is a maximum and a minimum
    histogram = logits.dtype in HISTOGRAM_DTYPES and V <= MAX_TRITON_VOCAB
    if backend == "triton" and not histogram:
        raise KernelBoundsError(
            f"backend='triton' takes bfloat16 or float16 logits of at most "
            f"{MAX_TRITON_VOCAB} tokens (got {logits.dtype}, {V} tokens)"
        )
    filtering = ordering or min_p > 0.0
    triton_run = filtering and (backend == "triton" or (ordering and histogram))
    if triton_run and checks.use_triton(backend, device):
        from dflash.kernels.filter_triton import launch_filter_floors

        if out is None:
            out = (torch.empty(T, dtype=torch.float32, device=device),
                   torch.empty(T, dtype=torch.int64, device=device))
        return launch_filter_floors(
            logits.contiguous(), it, top_k, top_p, min_p, out[0], out[1]
        )
    checks.use_triton(backend, device)  # a bad backend name is refused on every path
    return filter_floors_reference(logits, it, top_k, top_p, min_p, out=out)


def _check_number(name: str, value: object, lo: float, hi: float, *, lo_open: bool) -> None:
    ok = (
        not isinstance(value, bool) and isinstance(value, (int, float))
        and not math.isnan(value) and (lo < value if lo_open else lo <= value)
        and value <= hi
    )
    if not ok:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"'{name}' must be a number (got {type(value).__name__} {value!r})")
        bound = "(" if lo_open else "["
        raise KernelBoundsError(f"'{name}' must be in {bound}{lo}, {hi}] (got {value!r})")
