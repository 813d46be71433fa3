"""Torch reference of the chunked-prefill attention kernel (same signature as
:func:`dflash.kernels.prefill_attention.prefill_attention`, minus ``backend``).

Query rows are processed in blocks of consecutive positions. A block of ``n`` rows at
positions ``start + t0 .. start + t0 + n - 1`` sees cache rows ``0 .. start + t0 + n - 1``:
all of them but the last ``n`` are visible to every row of the block, and the last ``n``
(this block's own keys) form an ``n x n`` causal triangle, so only that square is masked.
Its scratch is the block's scores, ``[B, H, n, start + t0 + n]`` in the accumulation
dtype, plus one copy of the visible keys and values in that dtype: never ``T x T`` for
the whole chunk. ``n`` is at most :data:`QUERY_BLOCK` and shrinks for long contexts so
the scores stay under :data:`SCORE_ELEMENTS` elements.

Grouped heads are never expanded: the ``G = H // HKV`` query heads of one KV head become
``G * n`` query rows of that head (a ``[B, HKV, G, n, D]`` view of the block's queries),
so each key and value is multiplied as it lies in the cache.
"""

from __future__ import annotations

import torch

#: most query positions per block
QUERY_BLOCK = 256
#: most score elements one block may hold (256 MiB of float32); long contexts use fewer
#: query positions per block to stay under it
SCORE_ELEMENTS = 1 << 26


def prefill_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    start: int,
    *,
    scale: float | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of a prefill chunk against the KV cache, in torch.

    Arguments as :func:`dflash.kernels.prefill_attention.prefill_attention` (validated
    there): ``q [B, T, H, D]`` at positions ``start .. start + T - 1``, caches
    ``[B, HKV, S_max, D]`` whose rows ``0 .. start + T - 1`` hold the keys and values
    (rows past them are never read). Query row ``t`` attends cache rows ``0 .. start + t``;
    scores, softmax and the weighted sum run in float32 (float64 for float64 inputs) and
    the result is rounded once to q's dtype. Returns ``out`` (or a new ``[B, T, H, D]``
    tensor).
    """
    B, T, H, D = q.shape
    HKV = k_cache.shape[1]
    G = H // HKV
    acc_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    sm_scale = D**-0.5 if scale is None else float(scale)
    n_keys = start + T
    block = max(1, min(QUERY_BLOCK, SCORE_ELEMENTS // (B * H * n_keys)))
    # converted once (a no-op view when the cache is in the accumulation dtype); rows past
    # start + T are never touched
    keys = k_cache[:, :, :n_keys].to(acc_dtype)            # [B, HKV, start + T, D]
    values = v_cache[:, :, :n_keys].to(acc_dtype)
    y = torch.empty(B, T, H, D, dtype=q.dtype, device=q.device) if out is None else out
    for t0 in range(0, T, block):
        n = min(block, T - t0)
        seen = start + t0 + n                              # keys the block's last row sees
        # query head h = kv * G + g reads KV head kv: row g * n + i of KV head kv
        rows = q[:, t0 : t0 + n].to(acc_dtype).reshape(B, n, HKV, G, D)
        rows = rows.permute(0, 2, 3, 1, 4).reshape(B, HKV, G * n, D)
        scores = torch.matmul(rows, keys[:, :, :seen].transpose(2, 3))   # [B, HKV, G*n, seen]
        scores.mul_(sm_scale)
        # keys 0 .. start + t0 - 1 are visible to every row; the block's own n keys are a
        # causal triangle: row i (position start + t0 + i) sees key start + t0 + j iff j <= i
        hidden = torch.ones(n, n, dtype=torch.bool, device=q.device).triu_(1)
        scores.view(B, HKV, G, n, seen)[..., start + t0 :].masked_fill_(hidden, float("-inf"))
        # softmax in place (one scratch tensor); each row sees key 0, so its max is finite
        scores.sub_(scores.amax(dim=-1, keepdim=True)).exp_()
        scores.div_(scores.sum(dim=-1, keepdim=True))
        o = torch.matmul(scores, values[:, :, :seen])       # [B, HKV, G*n, D]
        o = o.view(B, HKV, G, n, D).permute(0, 3, 1, 2, 4).reshape(B, n, H, D)
        y[:, t0 : t0 + n].copy_(o)
    return y
