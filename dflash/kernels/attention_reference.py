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
    y = torch.empty(B, T, H, D, dtype=q.dtype, device=q.device)
    for b in range(B):
        for t in range(T):
            n = starts[b] + t + 1                       # visible keys 0 .. start + t
            k = k_cache[b, :, :n].to(acc_dtype)         # [HKV, n, D]
            v = v_cache[b, :, :n].to(acc_dtype)
            qr = q[b, t].to(acc_dtype, copy=True).view(HKV, G, D)   # head h -> KV h // G
            s = torch.matmul(qr, k.transpose(1, 2)) * sm_scale      # [HKV, G, n]
            p = torch.softmax(s, dim=-1)
            y[b, t] = torch.matmul(p, v).reshape(H, D).to(q.dtype)
    if out is None:
        return y
    out.copy_(y)
    return out
