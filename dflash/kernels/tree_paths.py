"""The root-to-node path table of a validated draft geometry, for tree-aware kernels.

``paths[t, d]`` is the slot of node ``t``'s ancestor at depth ``d`` for ``d <= depth(t)``
(so ``paths[t, 0] == 0`` and ``paths[t, depth(t)] == t``) and ``-1`` past it. A chain of
``T`` slots gives ``paths[t, d] = d`` for ``d <= t``. Kernels gather a node's history
through this table (e.g. :func:`~dflash.kernels.causal_conv1d_capture`'s ``paths=``).

Only :class:`~dflash.geometry.ChainGeometry` / :class:`~dflash.geometry.TreeGeometry` are
accepted, and only the validators build those, so a table made here always describes a
validated tree.
"""

from __future__ import annotations

import array

import torch

from dflash.errors import KernelBoundsError
from dflash.geometry import ChainGeometry, TreeGeometry


def tree_paths(geometry: ChainGeometry | TreeGeometry, device: torch.device | str) -> torch.Tensor:
    """The ``[T, T]`` int32 path table of ``geometry`` (``T = n_actual``) on ``device``.

    Raises:
        TypeError: ``geometry`` is not a validated geometry, or ``device`` is not a
            ``torch.device`` / ``str``.
        KernelBoundsError: ``device`` names no device.
    """
    T = _checked(geometry).n_actual
    table = _host_table(geometry, T)
    return table.to(_device(device))


def tree_paths_into(geometry: ChainGeometry | TreeGeometry, out: torch.Tensor) -> torch.Tensor:
    """Fill ``out`` (int32 ``[Tmax, Tmax]``, ``Tmax >= n_actual``) with the path table in
    its top-left ``[T, T]`` block and ``-1`` elsewhere, in one host-to-device copy
    (non-blocking from pinned memory on CUDA), so a CUDA graph replaying with ``out`` as a
    static buffer sees the new table. Returns ``out``.

    Raises:
        TypeError: ``geometry`` is not a validated geometry or ``out`` is not a tensor.
        KernelBoundsError: ``out`` is not int32, not square 2-D, or smaller than ``T``.
    """
    T = _checked(geometry).n_actual
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"'out' must be a torch.Tensor (got {type(out).__name__})")
    if out.dtype != torch.int32:
        raise KernelBoundsError(f"'out' must be torch.int32 (got {out.dtype})")
    if out.ndim != 2 or out.shape[0] != out.shape[1]:
        raise KernelBoundsError(
            f"'out' must be a square [Tmax, Tmax] tensor (got shape {tuple(out.shape)})"
        )
    Tmax = out.shape[0]
    if Tmax < T:
        raise KernelBoundsError(
            f"'out' holds Tmax={Tmax} slots but the geometry has n_actual={T}"
        )
    pinned = out.device.type == "cuda"
    host = torch.full((Tmax, Tmax), -1, dtype=torch.int32, pin_memory=pinned)
    host[:T, :T] = _host_table(geometry, T)
    # A pinned source block is held by torch's host allocator until the copy has run.
    out.copy_(host, non_blocking=pinned)
    return out


def reloaded_nodes(parents: tuple[int, ...]) -> list[int]:
    """Per node of a tree, 1 when a child that does not follow it directly (slot ``u + 1``)
    starts from its state — the nodes whose state a verify without checkpoints keeps in
    scratch — else 0. A chain has none; a tree in depth-first order only its branch points."""
    flags = [0] * len(parents)
    for child, parent in enumerate(parents):
        if parent >= 0 and parent != child - 1:
            flags[parent] = 1
    return flags


def tree_parents_into(geometry: TreeGeometry, out: torch.Tensor) -> torch.Tensor:
    """Fill ``out`` (int32, one-dimensional, at least ``2*T`` entries) with the table the
    recurrence kernel walks a tree by (``gdn_verify``'s ``tree_table``): the parents of the
    ``T`` nodes, then :func:`reloaded_nodes`' flags, in one host-to-device copy
    (non-blocking from pinned memory on CUDA), so a CUDA graph replaying with ``out`` as a
    static buffer sees the new tree. Returns ``out``.

    Raises:
        TypeError: ``geometry`` is not a validated ``TreeGeometry`` or ``out`` is not a
            tensor.
        KernelBoundsError: ``out`` is not int32, not one-dimensional, or shorter than
            ``2*T``.
    """
    if not isinstance(geometry, TreeGeometry):
        raise TypeError(
            "'geometry' must be a validated TreeGeometry (from validate_tree; got "
            f"{type(geometry).__name__})"
        )
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"'out' must be a torch.Tensor (got {type(out).__name__})")
    T = geometry.n_actual
    if out.dtype != torch.int32 or out.ndim != 1 or out.shape[0] < 2 * T:
        raise KernelBoundsError(
            f"'out' must be a one-dimensional int32 tensor of at least 2*T={2 * T} entries "
            f"(got {out.dtype}, shape {tuple(out.shape)})"
        )
    parents = tuple(geometry.parents)
    pinned = out.device.type == "cuda"
    host = torch.tensor([*parents, *reloaded_nodes(parents)], dtype=torch.int32)
    if pinned:
        host = host.pin_memory()
    # A pinned source block is held by torch's host allocator until the copy has run.
    out[: 2 * T].copy_(host, non_blocking=pinned)
    return out


def _checked(geometry: object) -> ChainGeometry | TreeGeometry:
    if not isinstance(geometry, (ChainGeometry, TreeGeometry)):
        raise TypeError(
            "'geometry' must be a validated ChainGeometry or TreeGeometry (from "
            f"validate_chain / validate_tree; got {type(geometry).__name__})"
        )
    return geometry


def _device(device: object) -> torch.device:
    if not isinstance(device, (torch.device, str)):
        raise TypeError(f"'device' must be a torch.device or str (got {type(device).__name__})")
    try:
        return torch.device(device)
    except RuntimeError:
        raise KernelBoundsError(f"'device' names no device (got {device!r})") from None


def tree_path_rows(geometry: ChainGeometry | TreeGeometry, width: int) -> array.array[int]:
    """The first ``T`` rows of the path table, ``width >= T`` entries each (``-1`` past a
    node's depth), flattened into a host int32 array (no tensor operations: a tree step
    builds it on the host every step)."""
    T = _checked(geometry).n_actual
    if width < T:
        raise KernelBoundsError(f"'width' {width} is narrower than the geometry's T={T}")
    rows = array.array("i")
    paths: list[list[int]] = []
    for t, p in enumerate(geometry.parents):
        path = [t] if p < 0 else [*paths[p], t]
        paths.append(path)
        rows.extend(path)
        rows.extend([-1] * (width - len(path)))
    return rows


def _host_table(geometry: ChainGeometry | TreeGeometry, T: int) -> torch.Tensor:
    """The ``[T, T]`` int32 table on the CPU."""
    return torch.frombuffer(tree_path_rows(geometry, T), dtype=torch.int32).view(T, T).clone()
