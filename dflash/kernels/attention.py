"""Public entry point: M-invariant causal attention for decode and verify steps."""

from __future__ import annotations

import math

import torch

from dflash.errors import KernelBoundsError
from dflash.kernels import checks
from dflash.kernels.attention_reference import decode_attention_reference

#: dtypes the Triton kernel accepts (the reference also takes float64).
TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
#: the Triton kernel holds a whole head dimension in one tile.
MAX_TRITON_D = 256
INDEX_DTYPES = (torch.int32, torch.int64)


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    start: torch.Tensor,
    *,
    scale: float | None = None,
    out: torch.Tensor | None = None,
    paths: torch.Tensor | None = None,
    backend: checks.Backend = "auto",
) -> torch.Tensor:
    """Attention of ``T`` new query rows against a static-capacity KV cache, causal by
    absolute position, with rows that do not depend on ``T``.

    Chain (``paths=None``): query row ``t`` of batch ``b`` sits at position
    ``start[b] + t`` and attends keys ``0 .. start[b] + t``. Its output is bitwise
    identical to a ``T = 1`` call made at that position (M-invariance): the Triton kernel
    walks keys in fixed blocks aligned to the absolute key index, splits the key range
    into chunks of a constant number of keys and combines the chunks in order; the
    reference loops over rows. ``start`` is read on the device only (the Triton path makes
    no host synchronisation and its grid depends on shapes alone, so it can be captured in
    a CUDA graph).

    Tree (``paths`` given, ``B == 1``): the ``T`` rows are the nodes of a draft tree (slot
    0 the root); node ``t``'s key and value are at cache row ``start + t`` (by slot), it
    sits at position ``start + depth(t)`` and attends the committed keys and its ancestors
    only. Row ``t`` walks a *logical* key sequence: logical key ``j`` is cache row ``j``
    for ``j < start`` and cache row ``start + paths[t, j - start]`` for
    ``start <= j <= start + depth(t)``: exactly the keys plain decoding holds at rows
    ``0 .. start + depth(t)`` when the path's tokens were decoded one by one. Blocks,
    splits and the combine are aligned to the logical index as in a chain, so the row's
    reduction is the one of a ``T = 1`` chain call at ``start + depth(t)`` on that plain
    cache, and its output is bitwise identical to it (whatever ``T`` and the tree's other
    nodes). The table is read on the device only on the Triton path.

    Args:
        q: ``[B, T, H, D]`` queries (float16/bfloat16/float32; float64 on the reference).
        k_cache, v_cache: ``[B, HKV, S_max, D]`` in q's dtype; rows ``0 .. start[b]+T-1``
            must already hold this step's keys and values. ``H`` is a multiple of ``HKV``:
            query head ``h`` reads KV head ``h // (H // HKV)``. Contiguous along ``D``.
        start: ``[B]`` int32/int64 on q's device, the position of query row 0.
            The caller guarantees ``0 <= start[b]`` and ``start[b] + T <= S_max``; the
            reference checks this (it reads ``start`` on the host); the Triton path cannot
            without a synchronisation, and never reads or writes outside the cache
            whatever ``start`` holds (keys at or past ``S_max`` are never loaded).
        scale: softmax scale, default ``D ** -0.5``.
        out: ``None`` (allocated) or ``[B, T, H, D]`` in q's dtype on q's device,
            contiguous along ``D``. Fully overwritten.
        paths: ``None`` (a chain) or the int32 ``[T, T]`` path table of the tree on q's
            device, unit stride along its last dimension (:func:`dflash.kernels.tree_paths`,
            or the top-left block of a :func:`dflash.kernels.tree_paths_into` buffer):
            ``paths[t, d]`` is the slot of node ``t``'s ancestor at depth ``d`` for
            ``d <= depth(t)`` (``paths[t, 0] == 0``, ``paths[t, depth(t)] == t``), ``-1``
            past it; ``depth(t)`` is the number of non-negative entries minus one.
            Needs ``B == 1``. The reference checks every
            row (it reads the table on the host); the Triton path cannot without a
            synchronisation, and never reads outside the cache or the table whatever it
            holds.
        backend: ``"auto"`` (Triton on CUDA tensors, or on CPU under
            ``TRITON_INTERPRET=1``; the reference otherwise), ``"triton"`` or
            ``"reference"``.

    Returns:
        ``out`` (or a new ``[B, T, H, D]`` tensor in q's dtype).

    Raises:
        TypeError: a tensor argument is not a tensor.
        ValueError: shapes, dtypes, devices, strides or ``scale`` are wrong, or
            ``paths`` with ``B > 1``; on the reference also ``start`` out of range or a
            ``paths`` row that is not a root-to-node path.
    """
    q = checks.tensor("q", q, 4)
    B, T, H, D = q.shape
    if B < 1 or T < 1 or H < 1 or D < 1:
        raise ValueError(f"'q' must have B, T, H, D >= 1 (got shape {tuple(q.shape)})")
    k_cache = checks.tensor("k_cache", k_cache, 4)
    HKV, S_max = k_cache.shape[1], k_cache.shape[2]
    checks.shape("k_cache", k_cache, (B, HKV, S_max, D), "[B, HKV, S_max, D] with B, D from q")
    if HKV < 1 or H % HKV != 0:
        raise ValueError(f"'q' heads H={H} must be a positive multiple of k_cache's HKV={HKV}")
    if S_max < T:
        raise ValueError(f"'k_cache' capacity S_max={S_max} must be >= T={T}")
    v_cache = checks.tensor("v_cache", v_cache, 4)
    checks.shape("v_cache", v_cache, (B, HKV, S_max, D), "k_cache.shape [B, HKV, S_max, D]")
    checks.dtype("k_cache", k_cache, q.dtype)
    checks.dtype("v_cache", v_cache, q.dtype)
    if not isinstance(start, torch.Tensor):
        raise TypeError(f"'start' must be a torch.Tensor (got {type(start).__name__})")
    if start.dtype not in INDEX_DTYPES or tuple(start.shape) != (B,):
        raise ValueError(
            f"'start' must be an int32/int64 tensor of shape [B] = ({B},) "
            f"(got {start.dtype}, {tuple(start.shape)})"
        )
    if scale is not None and (
        isinstance(scale, bool) or not isinstance(scale, (int, float))
        or not math.isfinite(scale)
    ):
        raise ValueError(f"'scale' must be a finite number or None (got {scale!r})")
    if out is not None:
        out = checks.tensor("out", out, 4)
        checks.shape("out", out, (B, T, H, D), "q.shape [B, T, H, D]")
        checks.dtype("out", out, q.dtype)
    if paths is not None:
        _check_paths(paths, B, T)
    device = checks.same_device({
        "q": q, "k_cache": k_cache, "v_cache": v_cache, "start": start, "out": out,
        "paths": paths,
    })
    if not checks.use_triton(backend, device):
        return decode_attention_reference(
            q, k_cache, v_cache, start, scale=scale, out=out, paths=paths
        )
    if q.dtype not in TRITON_DTYPES:
        raise ValueError(
            f"'q' dtype must be float16, bfloat16 or float32 for Triton (got {q.dtype})"
        )
    if D > MAX_TRITON_D:
        raise ValueError(f"'q' head dim D must be <= {MAX_TRITON_D} for Triton (got {D})")
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("out", out)):
        if t is not None and t.stride(-1) != 1 and D > 1:
            raise ValueError(
                f"'{name}' must be contiguous along D (got strides {t.stride()})"
            )
    from dflash.kernels.attention_triton import launch_decode_attention

    return launch_decode_attention(
        q, k_cache, v_cache, start, D**-0.5 if scale is None else float(scale), out,
        paths=paths,
    )


def _check_paths(paths: object, B: int, T: int) -> None:
    """The tree table's type, dtype, shape and batch (its contents are not read here)."""
    if not isinstance(paths, torch.Tensor):
        raise TypeError(f"'paths' must be a torch.Tensor or None (got {type(paths).__name__})")
    if paths.dtype != torch.int32 or tuple(paths.shape) != (T, T):
        raise KernelBoundsError(
            f"'paths' must be an int32 tensor of shape [T, T] = ({T}, {T}) "
            f"(got {paths.dtype}, {tuple(paths.shape)})"
        )
    if B != 1:
        raise KernelBoundsError(
            f"'paths' (a tree verify) needs B = 1: one draft tree per call (got B={B})"
        )
    if paths.stride(1) != 1 and T > 1:
        raise KernelBoundsError(
            f"'paths' must be contiguous along its last dimension (got strides {paths.stride()})"
        )
