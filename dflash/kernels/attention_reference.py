"""Torch reference of the decode/verify attention kernel (same signature as
:func:`decode_attention`).

A loop over (batch, query row): row ``t`` of batch ``b`` attends exactly its visible keys
with a float32 softmax (float64 for float64 inputs). A chain row sees cache rows
``0 .. start[b] + t``; a tree row (``paths``) sees its logical key sequence: the
committed rows ``0 .. start - 1`` followed by its path's keys, laid out at contiguous
rows ``start .. start + depth(t)`` of a scratch copy of the cache, i.e. exactly the cache
plain decoding would hold for that node. Each row is computed from its own query and
those keys alone, by the same code for both kinds, so the result does not depend on how
many query rows share the call, and a tree row equals the one-row chain call at
``start + depth(t)`` on that plain cache bit for bit.
"""

from __future__ import annotations

import itertools

import torch

from dflash.errors import KernelBoundsError


def decode_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    start: torch.Tensor,
    *,
    scale: float | None = None,
    out: torch.Tensor | None = None,
    paths: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of ``T`` query rows against a static-capacity KV cache.

    Arguments as :func:`dflash.kernels.decode_attention` (validated there); ``start`` is
    read on the host here and must satisfy ``0 <= start[b]`` and
    ``start[b] + T <= S_max`` (``ValueError`` otherwise). ``paths`` (a tree verify, B = 1)
    is read on the host too and each row must be a root-to-node path
    (:func:`tree_rows`).
    """
    B, T, H, D = q.shape
    HKV = k_cache.shape[1]
    G = H // HKV
    acc_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    sm_scale = D**-0.5 if scale is None else float(scale)
    S_max = k_cache.shape[2]
    starts = [int(s) for s in start.tolist()]
    for b, s0 in enumerate(starts):
        if s0 < 0 or s0 + T > S_max:
            raise ValueError(
                f"'start' must satisfy 0 <= start[b] and start[b] + T <= S_max = {S_max} "
                f"(got start[{b}] = {s0}, T={T})"
            )
    tree = None if paths is None else tree_rows(paths)
    y = torch.empty(B, T, H, D, dtype=acc_dtype, device=q.device)
    for b, s0 in enumerate(starts):
        queries = q[b].to(acc_dtype).reshape(T, HKV, G, D)  # head h -> KV h // G
        if tree is None:
            # converted once per batch row (a no-op view in the accumulation dtype); row t
            # reads its visible prefix of them
            keys = k_cache[b, :, : s0 + T].to(acc_dtype)       # [HKV, s0 + T, D]
            values = v_cache[b, :, : s0 + T].to(acc_dtype)
            for t in range(T):
                _attend(queries[t], keys, values, s0 + t + 1, sm_scale, y[b, t])
            continue
        # the plain cache of each node: committed rows, then its path at start .. start+depth
        plain_k = torch.empty_like(k_cache[b])
        plain_v = torch.empty_like(v_cache[b])
        plain_k[:, :s0] = k_cache[b, :, :s0]
        plain_v[:, :s0] = v_cache[b, :, :s0]
        for t, path in enumerate(tree):
            n = s0 + len(path)                             # keys 0 .. start + depth(t)
            rows = torch.tensor([s0 + slot for slot in path], device=k_cache.device)
            plain_k[:, s0:n] = k_cache[b].index_select(1, rows)
            plain_v[:, s0:n] = v_cache[b].index_select(1, rows)
            # what a one-row chain call at position n - 1 converts and reads
            keys = plain_k[:, :n].to(acc_dtype)
            values = plain_v[:, :n].to(acc_dtype)
            _attend(queries[t], keys, values, n, sm_scale, y[b, t])
    y = y.to(q.dtype)
    if out is None:
        return y
    out.copy_(y)
    return out


def _attend(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, n: int,
            sm_scale: float, y: torch.Tensor) -> None:
    """One query row (``[HKV, G, D]``) over ``keys/values[:, :n]`` into ``y`` (``[H, D]``)."""
    HKV, G, D = query.shape
    scores = torch.bmm(query, keys[:, :n].transpose(1, 2)).mul_(sm_scale)
    p = torch.softmax(scores, dim=-1)                      # [HKV, G, n]
    torch.bmm(p, values[:, :n], out=y.view(HKV, G, D))


def tree_rows(paths: torch.Tensor) -> list[list[int]]:
    """The root-to-node paths of an int32 ``[T, T]`` table, read on the host and checked.

    Row ``t`` must list strictly increasing slots from ``0`` (the root) to ``t``, padded
    with ``-1``, and without its last entry it must equal its parent's row (the table
    describes one tree); row 0 is ``[0, -1, ...]``. Raises ``KernelBoundsError`` (a
    ``ValueError``) naming the first bad row.
    """
    table = paths.tolist()
    rows: list[list[int]] = []
    for t, entries in enumerate(table):
        path = [e for e in entries if e >= 0]
        depth = len(path) - 1
        well_formed = (
            depth >= 0
            and entries[: depth + 1] == path
            and all(e == -1 for e in entries[depth + 1 :])
            and path[0] == 0
            and path[-1] == t
            and all(a < b for a, b in itertools.pairwise(path))
            and (depth == 0 or rows[path[-2]] == path[:-1])
        )
        if not well_formed:
            raise KernelBoundsError(
                f"'paths' row {t} must be a root-to-node path: strictly increasing slots "
                f"from 0 to {t}, each prefix its parent's row, padded with -1 (got {entries})"
            )
        rows.append(path)
    return rows
