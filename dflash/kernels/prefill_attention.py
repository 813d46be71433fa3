"""Public entry point: causal attention of a prefill chunk against the KV cache."""

from __future__ import annotations

import math

import torch

from dflash.errors import KernelBoundsError
from dflash.kernels import checks
from dflash.kernels.prefill_attention_reference import prefill_attention_reference

#: dtypes the Triton kernel accepts (the reference also takes float64).
TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
#: the Triton kernel holds a whole head dimension in one tile.
MAX_TRITON_D = 256


def prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    start: int,
    *,
    scale: float | None = None,
    out: torch.Tensor | None = None,
    backend: checks.Backend = "auto",
) -> torch.Tensor:
    """Attention of a prefill chunk of ``T`` query rows against the KV cache, causal by
    absolute position, in memory linear in ``T``.

    Query row ``t`` sits at position ``start + t`` and attends cache rows
    ``0 .. start + t`` (lower-right causal: the chunk's own keys and values are already in
    cache rows ``start .. start + T - 1``). Cache rows at or past ``start + T`` are never
    read, so they may hold anything, NaN included. Neither backend forms a ``T x T`` or
    ``T x S`` tensor: the Triton kernel is a flash-attention forward (online softmax over
    key blocks, scratch of one tile per program); the reference walks the queries in
    blocks of at most 256 positions. The result is deterministic but, unlike
    :func:`dflash.kernels.decode_attention`, not independent of ``T``: a prefill may run
    any kernel. ``start`` is a host int (a prefill is never captured in a CUDA graph), so
    it is checked here, and the Triton kernel is compiled once for every position.

    Args:
        q: ``[B, T, H, D]`` queries (float16/bfloat16/float32; float64 on the reference).
        k_cache, v_cache: ``[B, HKV, S_max, D]`` in q's dtype, any strides (typically
            ``cache[i]`` of a ``[L, B, HKV, S_max, D]`` buffer); rows
            ``0 .. start + T - 1`` must hold the keys and values. ``H`` is a multiple of
            ``HKV``: query head ``h`` reads KV head ``h // (H // HKV)``.
        start: the position of query row 0, a Python int with
            ``0 <= start`` and ``start + T <= S_max``.
        scale: softmax scale, default ``D ** -0.5``.
        out: ``None`` (allocated) or ``[B, T, H, D]`` in q's dtype on q's device, sharing
            no memory with q or the caches. Fully overwritten.
        backend: ``"auto"`` (Triton on CUDA tensors, or on CPU under
            ``TRITON_INTERPRET=1``; the reference otherwise), ``"triton"`` or
            ``"reference"``. The Triton path needs ``D <= 256``, a float16/bfloat16/float32
            dtype and every tensor contiguous along ``D``.

    Returns:
        ``out`` (or a new ``[B, T, H, D]`` tensor in q's dtype).

    Raises:
        TypeError: a tensor argument is not a tensor, ``start`` is not an int (a bool or
            a tensor included), ``scale`` is not a number.
        KernelBoundsError: (a ``ValueError``) shapes, dtypes, devices, strides, ``start``
            out of range, a non-finite ``scale``, an overlapping ``out`` or an unknown
            ``backend``; each message names the argument and the value.
    """
    q = checks.tensor("q", q, 4)
    B, T, H, D = q.shape
    if B < 1 or T < 1 or H < 1 or D < 1:
        raise KernelBoundsError(f"'q' must have B, T, H, D >= 1 (got shape {tuple(q.shape)})")
    k_cache = checks.tensor("k_cache", k_cache, 4)
    HKV, S_max = k_cache.shape[1], k_cache.shape[2]
    checks.shape("k_cache", k_cache, (B, HKV, S_max, D), "[B, HKV, S_max, D] with B, D from q")
    if HKV < 1 or H % HKV != 0:
        raise KernelBoundsError(
            f"'q' heads H={H} must be a positive multiple of k_cache's HKV={HKV}"
        )
    v_cache = checks.tensor("v_cache", v_cache, 4)
    checks.shape("v_cache", v_cache, (B, HKV, S_max, D), "k_cache.shape [B, HKV, S_max, D]")
    checks.dtype("k_cache", k_cache, q.dtype)
    checks.dtype("v_cache", v_cache, q.dtype)
    if isinstance(start, bool) or not isinstance(start, int):
        raise TypeError(
            f"'start' must be a Python int, the position of query row 0 "
            f"(got {type(start).__name__})"
        )
    if start < 0 or start + T > S_max:
        raise KernelBoundsError(
            f"'start' must satisfy 0 <= start and start + T <= S_max "
            f"(got start={start}, T={T}, S_max={S_max})"
        )
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))):
        raise TypeError(f"'scale' must be a number or None (got {type(scale).__name__})")
    if scale is not None and not math.isfinite(scale):
        raise KernelBoundsError(f"'scale' must be finite (got {scale!r})")
    if out is not None:
        out = checks.tensor("out", out, 4)
        checks.shape("out", out, (B, T, H, D), "q.shape [B, T, H, D]")
        checks.dtype("out", out, q.dtype)
    device = checks.same_device({"q": q, "k_cache": k_cache, "v_cache": v_cache, "out": out})
    if out is not None:
        checks.disjoint("out", out, {"q": q, "k_cache": k_cache, "v_cache": v_cache})
    if not checks.use_triton(backend, device):
        return prefill_attention_reference(q, k_cache, v_cache, start, scale=scale, out=out)
    if q.dtype not in TRITON_DTYPES:
        raise KernelBoundsError(
            f"'q' dtype must be float16, bfloat16 or float32 for Triton (got {q.dtype})"
        )
    if D > MAX_TRITON_D:
        raise KernelBoundsError(
            f"'q' head dim D must be <= {MAX_TRITON_D} for Triton (got {D})"
        )
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("out", out)):
        if t is not None and t.stride(-1) != 1 and D > 1:
            raise KernelBoundsError(
                f"'{name}' must be contiguous along D for Triton (got strides {t.stride()})"
            )
    from dflash.kernels.prefill_attention_triton import launch_prefill_attention

    return launch_prefill_attention(
        q, k_cache, v_cache, start, D**-0.5 if scale is None else float(scale), out
    )
