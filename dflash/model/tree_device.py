"""Tree acceptance and its follow-ups on the device, without a host round trip.

Three functions a captured tree step chains after the verify forward, each the device twin
of a host reference:

- :func:`accept_tree_device` — :func:`dflash.model.drafters.trees.accept_tree`: the deepest
  accepted slot (the lowest of equals) and its root-to-node path;
- :func:`conv_window_rows_device` — :func:`dflash.model.caches.path_window_rows`: the
  captured rows that make the conv window after that path;
- :func:`compact_kv_device` — :meth:`dflash.model.caches.KVCache.compact`: the path's KV
  rows moved to the front of the verify window.

They read only tensors' shapes on the host (no ``.item()``, no data-dependent shape, no
branch on a tensor's value), so every output shape is a function of the input shapes and a
CUDA graph can hold them. Preconditions on tensor *values* (a valid path table, ``count`` in
``[1, n]``, ``start + n <= max_len``) are therefore documented, not checked.

Padding convention: a path is a ``[n]`` int64 tensor whose first ``count`` entries are the
accepted slots by depth (``path[0] == 0``, ``path[count - 1] == best``) and whose remaining
``n - count`` entries are ``-1``.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["accept_tree_device", "compact_kv_device", "conv_window_rows_device"]


def accept_tree_device(
    tokens: Tensor, target: Tensor, depth: Tensor, paths: Tensor, n: int
) -> tuple[Tensor, Tensor, Tensor]:
    """Tree acceptance of the first ``n`` slots on the device.

    Args:
        tokens: ``[>= n]`` the drafted token of each slot (``tokens[0]`` the root).
        target: ``[>= n]`` the target's greedy token after each slot's path.
        depth: ``[>= n]`` int64, each slot's depth (:class:`~dflash.model.caches.TreeTables`).
        paths: ``[>= n, >= n]`` int32 or int64 path table
            (:func:`dflash.kernels.tree_paths_into`); only its ``[n, n]`` corner is read, and
            it must be the table of a valid tree (``-1`` past each depth) whose depths
            ``depth[:n]`` holds.
        n: the tree's slot count, ``>= 1``.

    Returns:
        ``(best, count, path)``: ``best [1]`` int64, the deepest accepted slot, the lowest
        of equally deep ones; ``count [1]`` int64, ``depth[best] + 1``; ``path [n]`` int64,
        ``paths[best, :n]``: the path, then the table's ``-1`` past the depth (the module's
        padding convention).

    Slot ``s != 0`` matches when ``tokens[s] == target[parent(s)]``, ``parent(s) =
    paths[s, depth[s] - 1]``; it is accepted when every slot on its path matches (the root
    always is). The winner is the argmax of the key ``(depth + 1) * (n + 1) + (n - s)`` over
    accepted slots (0 elsewhere): ``n - s`` lies in ``[1, n]``, so the keys of distinct
    slots differ, deeper beats shallower, and of equal depths the lower slot wins.

    Raises:
        ValueError: ``n < 1``, a tensor of the wrong rank, shorter than ``n``, or on
            another device than ``tokens``.
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"'n' must be an int >= 1 (got {n!r})")
    for name, t in (("tokens", tokens), ("target", target), ("depth", depth)):
        if t.ndim != 1 or t.shape[0] < n:
            raise ValueError(f"{name!r} must be [>= n={n}] (got shape {tuple(t.shape)})")
    if paths.ndim != 2 or paths.shape[0] < n or paths.shape[1] < n:
        raise ValueError(f"'paths' must be [>= n, >= n] with n={n} (got {tuple(paths.shape)})")
    _same_device("tokens", tokens=tokens, target=target, depth=depth, paths=paths)

    device = tokens.device
    slot = torch.arange(n, dtype=torch.int64, device=device)  # [n]
    d = depth[:n].to(torch.int64)  # [n]
    table = paths[:n, :n].to(torch.int64)  # [n, n], -1 past each depth
    # parent of s: its ancestor at depth d-1 (the root's clamped index names itself)
    parent = table.gather(1, (d - 1).clamp(min=0).unsqueeze(1)).squeeze(1)  # [n]
    match = (tokens[:n] == target[:n].index_select(0, parent)) | (slot == 0)  # [n]
    # every slot on the path matches; a -1 past the depth reads the root, which always does
    hits = match.index_select(0, table.clamp(min=0).reshape(-1)).view(n, n)
    accepted = hits.all(dim=1)  # [n]
    key = accepted.to(torch.int64) * ((d + 1) * (n + 1) + (n - slot))  # [n], distinct if > 0
    best = key.argmax(dim=0, keepdim=True)  # [1]
    count = d.index_select(0, best) + 1  # [1]
    path = table.index_select(0, best).squeeze(0)  # [n], the table's -1 past the depth
    return best, count, path


def conv_window_rows_device(path: Tensor, count: Tensor, kc1: int) -> Tensor:
    """The captured rows that make the conv window after ``path``, on the device.

    Args:
        path: ``[n]`` int64, a root-to-node path padded with ``-1`` (as
            :func:`accept_tree_device` returns it).
        count: ``[1]`` int64, the path's real length, in ``[1, n]``.
        kc1: the conv kernel size minus one, ``>= 0``.

    Returns:
        ``[kc1]`` int64: entries ``count … count + kc1 - 1`` of ``concat(range(kc1), kc1 +
        path)``, i.e. :func:`~dflash.model.caches.path_window_rows` of the real path. An
        entry ``j >= kc1`` reads ``path[j - kc1]`` with ``j - kc1 < count``, so the padding
        is never read, and ``j < count + kc1 <= n + kc1`` stays inside the concatenation.

    Raises:
        ValueError: ``kc1 < 0``, or ``path`` / ``count`` of the wrong shape or device.
    """
    if isinstance(kc1, bool) or not isinstance(kc1, int) or kc1 < 0:
        raise ValueError(f"'kc1' must be an int >= 0 (got {kc1!r})")
    if path.ndim != 1:
        raise ValueError(f"'path' must be [n] (got shape {tuple(path.shape)})")
    if count.shape != (1,):
        raise ValueError(f"'count' must be [1] (got shape {tuple(count.shape)})")
    _same_device("path", path=path, count=count)
    window = torch.arange(kc1, dtype=torch.int64, device=path.device)  # [kc1]
    rows = torch.cat((window, kc1 + path.to(torch.int64)))  # [kc1 + n]
    return rows.index_select(0, count.to(torch.int64) + window)


def compact_kv_device(k: Tensor, v: Tensor, start: Tensor, path: Tensor, dim: int = 3) -> None:
    """Move the accepted path's KV rows to the front of the verify window, in place.

    Args:
        k, v: caches, ``[L, B, HKV, max_len, D]`` for the default ``dim``; ``L`` may be 0.
        start: ``[1]`` int64, the row of slot 0; ``start + n <= max_len``.
        path: ``[n]`` int64, a strictly increasing root-to-node path padded with ``-1``.
        dim: the position dimension of ``k`` and ``v``.

    Row ``start + path[i]`` moves to ``start + i`` for every real entry; a padding entry
    copies row ``start + i`` onto itself, so rows ``start + count … start + n - 1`` keep
    their bits, and rows outside ``start … start + n - 1`` are never written. The sources
    are gathered into a temporary before the scatter, so a row read is never one already
    overwritten. Equals :meth:`~dflash.model.caches.KVCache.compact` on the rows (the
    cache's ``length`` is host bookkeeping and stays with the caller).

    Raises:
        ValueError: ``k`` and ``v`` differ in shape or device, ``dim`` is not one of their
            dimensions, or ``start`` / ``path`` have the wrong shape or device.
    """
    if k.shape != v.shape:
        raise ValueError(f"'k' and 'v' must have one shape (got {tuple(k.shape)}, "
                         f"{tuple(v.shape)})")
    if not -k.ndim <= dim < k.ndim:
        raise ValueError(f"'dim' must be a dimension of the {k.ndim}-D caches (got {dim})")
    if start.shape != (1,):
        raise ValueError(f"'start' must be [1] (got shape {tuple(start.shape)})")
    if path.ndim != 1:
        raise ValueError(f"'path' must be [n] (got shape {tuple(path.shape)})")
    _same_device("k", k=k, v=v, start=start, path=path)
    slot = torch.arange(path.shape[0], dtype=torch.int64, device=path.device)  # [n]
    path = path.to(torch.int64)
    dst = start.to(torch.int64) + slot  # [n]
    src = start.to(torch.int64) + torch.where(path >= 0, path, slot)  # [n], padding: dst
    for cache in (k, v):
        cache.index_copy_(dim, dst, cache.index_select(dim, src))


def _same_device(first: str, **tensors: Tensor) -> None:
    """Every tensor on the device of ``tensors[first]``."""
    device = tensors[first].device
    for name, t in tensors.items():
        if t.device != device:
            raise ValueError(f"{name!r} is on {t.device}, {first!r} on {device}")
