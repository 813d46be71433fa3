"""Torch reference of the decode/verify attention kernel (same signature as
:func:`decode_attention`).

A loop over (batch, query row): row ``t`` of batch ``b`` attends exactly the visible keys
``0 .. start[b] + t`` of its KV head with a float32 softmax (float64 for float64 inputs).
Each row is computed from its own query and those keys alone, so the result does not
depend on how many query rows share the call.
"""

from __future__ import annotations

import torch


def decode_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    start: torch.Tensor,
    *,
    scale: float | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of ``T`` query rows against a static-capacity KV cache.

    Arguments as :func:`dflash.kernels.decode_attention` (validated there); ``start`` is
    read on the host here and must satisfy ``0 <= start[b]`` and
    ``start[b] + T <= S_max`` (``ValueError`` otherwise).
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
    y = torch.empty(B, T, H, D, dtype=acc_dtype, device=q.device)
    for b, s0 in enumerate(starts):
        # converted once per batch row (a no-op view in the accumulation dtype); row t
        # reads its visible prefix of them
        keys = k_cache[b, :, : s0 + T].to(acc_dtype)       # [HKV, s0 + T, D]
        values = v_cache[b, :, : s0 + T].to(acc_dtype)
        queries = q[b].to(acc_dtype).reshape(T, HKV, G, D)  # head h -> KV h // G
        for t in range(T):
            n = s0 + t + 1                                 # visible keys 0 .. start + t
            scores = torch.bmm(queries[t], keys[:, :n].transpose(1, 2)).mul_(sm_scale)
            p = torch.softmax(scores, dim=-1)              # [HKV, G, n]
            torch.bmm(p, values[:, :n], out=y[b, t].view(HKV, G, D))
    y = y.to(q.dtype)
    if out is None:
        return y
    out.copy_(y)
    return out
