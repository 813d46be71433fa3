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
from collections.abc import Sequence

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


def tree_walks(parents: Sequence[int]) -> list[list[int]]:
    """How the recurrence kernel walks a tree in two launches: walk 0 is the *trunk* (the
    root, then each node's lowest-slot child, down to a leaf); every other walk is the
    whole subtree of one child of a trunk node that is not on the trunk, its slots in
    ascending order (a parent before its children). The trunk runs first, then every
    subtree at once, each from its trunk parent's state: a tree of ``T`` nodes costs the
    trunk's length plus its largest subtree in serial steps instead of ``T``. A chain is
    one walk."""
    T = len(parents)
    children: list[list[int]] = [[] for _ in range(T)]
    for child, parent in enumerate(parents):
        if parent >= 0:
            children[parent].append(child)
    trunk = [0]
    while children[trunk[-1]]:
        trunk.append(children[trunk[-1]][0])
    walks = [trunk]
    for i, u in enumerate(trunk):
        for c in children[u]:
            if i + 1 < len(trunk) and c == trunk[i + 1]:
                continue
            sub, stack = [], [c]
            while stack:
                x = stack.pop()
                sub.append(x)
                stack.extend(children[x])
            walks.append(sorted(sub))
    return walks


def reloaded_nodes(parents: Sequence[int]) -> list[int]:
    """Per node of a tree, 1 when a node starts from its state without following it in its
    walk (:func:`tree_walks`) — the nodes whose state a verify without checkpoints keeps
    in scratch — else 0: the trunk nodes that subtrees hang from, and inside a subtree the
    nodes whose child is not the next slot of the walk. A chain has none."""
    return _reloaded(parents, tree_walks(parents))


def _reloaded(parents: Sequence[int], walks: list[list[int]]) -> list[int]:
    """:func:`reloaded_nodes` of a tree whose :func:`tree_walks` are ``walks``."""
    flags = [0] * len(parents)
    for walk in walks:
        prev = -1
        for node in walk:
            if parents[node] >= 0 and parents[node] != prev:
                flags[parents[node]] = 1
            prev = node
    return flags


def tree_table_values(parents: Sequence[int], width: int | None = None) -> array.array[int]:
    """The recurrence kernel's table of a tree of ``T`` nodes, int32: the parents, the
    :func:`reloaded_nodes` flags, then ``T`` rows of ``width`` (default ``T``) entries,
    row ``w`` the slots of walk ``w`` (:func:`tree_walks`) then ``-1``; rows past the
    walks are ``-1``. The kernel reads row ``w`` at ``2 T + w T``: ``width`` must be ``T``
    there (a wider table is for callers that slice it)."""
    T = len(parents)
    width = T if width is None else width
    walks = tree_walks(parents)
    values = array.array("i", parents)
    values.extend(_reloaded(parents, walks))
    start = len(values)
    values.extend(_MINUS_ONE * (width * T))  # every row -1, then each walk written in
    for w, walk in enumerate(walks):
        at = start + w * width
        values[at : at + len(walk)] = array.array("i", walk)
    return values


#: one int32 -1, repeated to fill a table
_MINUS_ONE = array.array("i", [-1])


def tree_table_size(T: int) -> int:
    """Entries of the recurrence kernel's table for ``T`` nodes (:func:`tree_table_values`)."""
    return 2 * T + T * T


def tree_parents_into(geometry: TreeGeometry, out: torch.Tensor) -> torch.Tensor:
    """Fill ``out`` (int32, one-dimensional, at least ``2*T + T*T`` entries) with the table
    the recurrence kernel walks a tree by (``gdn_verify``'s ``tree_table``,
    :func:`tree_table_values`): the parents of the ``T`` nodes, :func:`reloaded_nodes`'
    flags and the walks, in one host-to-device copy (non-blocking from pinned memory on
    CUDA), so a CUDA graph replaying with ``out`` as a static buffer sees the new tree.
    Returns ``out``.

    Raises:
        TypeError: ``geometry`` is not a validated ``TreeGeometry`` or ``out`` is not a
            tensor.
        KernelBoundsError: ``out`` is not int32, not one-dimensional, or shorter than
            ``2*T + T*T``.
    """
    if not isinstance(geometry, TreeGeometry):
        raise TypeError(
            "'geometry' must be a validated TreeGeometry (from validate_tree; got "
            f"{type(geometry).__name__})"
        )
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"'out' must be a torch.Tensor (got {type(out).__name__})")
    T = geometry.n_actual
    n = tree_table_size(T)
    if out.dtype != torch.int32 or out.ndim != 1 or out.shape[0] < n:
        raise KernelBoundsError(
            f"'out' must be a one-dimensional int32 tensor of at least 2*T + T*T={n} "
            f"entries (got {out.dtype}, shape {tuple(out.shape)})"
        )
    pinned = out.device.type == "cuda"
    host = torch.frombuffer(tree_table_values(geometry.parents), dtype=torch.int32)
    if pinned:
        host = host.pin_memory()
    # A pinned source block is held by torch's host allocator until the copy has run.
    out[:n].copy_(host, non_blocking=pinned)
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
    rows = _MINUS_ONE * (T * width)
    paths: list[array.array[int]] = []
    for t, p in enumerate(geometry.parents):
        path = array.array("i", [t]) if p < 0 else paths[p] + array.array("i", [t])
        paths.append(path)
        rows[t * width : t * width + len(path)] = path
    return rows


def _host_table(geometry: ChainGeometry | TreeGeometry, T: int) -> torch.Tensor:
    """The ``[T, T]`` int32 table on the CPU."""
    return torch.frombuffer(tree_path_rows(geometry, T), dtype=torch.int32).view(T, T).clone()
