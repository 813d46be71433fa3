"""Public entry point: the top-p (nucleus) cut of rows of sorted scores.

For a row ``s`` of temperature-scaled logits sorted in descending order (``s_0`` finite,
``-inf`` allowed at the tail), ``p_j = exp(s_j - s_0) / Z`` with ``Z = sum_j exp(s_j - s_0)``
and ``before_j = p_0 + ... + p_{j-1}`` (exclusive prefix sum, ``before_0 = 0``);
``n_keep`` is the number of leading entries with ``before_j < top_p``. ``before_j`` never
decreases, so the kept entries are a prefix, and ``n_keep >= 1``. Everything is float32.
"""

from __future__ import annotations

import math

import torch

from dflash.errors import KernelBoundsError
from dflash.kernels import checks
from dflash.kernels.top_p_reference import top_p_count_reference

#: Longest row: offsets inside a row are int32 and the last chunk may reach 4096 past V.
MAX_VOCAB = 1 << 30


def top_p_count(
    sorted_scores: torch.Tensor,
    top_p: float,
    *,
    out: torch.Tensor | None = None,
    backend: checks.Backend = "auto",
) -> torch.Tensor:
    """How many of each row's most probable entries the top-p filter keeps.

    A row's count depends on that row alone (M-invariant): one program per row on Triton,
    each row summed in a fixed order; one row at a time on the reference. The two may
    differ only where some ``before_j`` lies within a few float32 ulps of ``top_p``.

    Args:
        sorted_scores: ``[T, V]`` contiguous float32 tensor, ``T >= 1``, ``1 <= V <= 2**30``,
            each row sorted in descending order with a finite first entry (not checked:
            that would read the tensor back to the host); ``-inf`` entries have ``p = 0``.
        top_p: a float with ``0 < top_p < 1``, compared in float32 (rounded to float32).
        out: ``None`` (allocated) or a contiguous ``[T]`` int64 tensor on the scores'
            device, sharing no memory with them; receives ``n_keep``.
        backend: ``"auto"``, ``"triton"`` or ``"reference"`` (see ``gdn_verify``).

    Returns:
        ``n_keep: [T]`` int64 with ``1 <= n_keep[i] <= V`` (``out`` when given).

    Raises:
        TypeError: ``sorted_scores`` or ``out`` is not a tensor, or ``top_p`` is not a
            number (a ``bool`` is refused).
        KernelBoundsError: shape, dtype, layout, device, ``top_p``'s range or ``out`` is
            wrong (a ``ValueError``).
    """
    sorted_scores = checks.tensor_of("sorted_scores", sorted_scores, 2, torch.float32)
    T, V = sorted_scores.shape
    if T < 1 or not 1 <= V <= MAX_VOCAB:
        raise KernelBoundsError(
            f"'sorted_scores' must be [T, V] with T >= 1 and 1 <= V <= {MAX_VOCAB} "
            f"(got shape {(T, V)})"
        )
    if not sorted_scores.is_contiguous():
        raise KernelBoundsError(
            f"'sorted_scores' must be contiguous (got strides {sorted_scores.stride()} "
            f"for shape {(T, V)})"
        )
    if isinstance(top_p, bool) or not isinstance(top_p, (int, float)):
        raise TypeError(f"'top_p' must be a float (got {type(top_p).__name__} {top_p!r})")
    if not (math.isfinite(top_p) and 0 < top_p < 1):
        raise KernelBoundsError(f"'top_p' must be a float in (0, 1) (got {top_p!r})")
    top_p32 = torch.tensor(top_p, dtype=torch.float32).item()  # exactly what is compared
    inputs: dict[str, torch.Tensor | None] = {"sorted_scores": sorted_scores}
    if out is not None:
        out = checks.output("out", out, (T,), torch.int64, "[T] with T from sorted_scores")
        checks.disjoint("out", out, inputs)
    device = checks.same_device({**inputs, "out": out})
    if checks.use_triton(backend, device):
        from dflash.kernels.top_p_triton import launch_top_p_count

        return launch_top_p_count(sorted_scores, top_p32, out=out)
    return top_p_count_reference(sorted_scores, top_p32, out=out)
