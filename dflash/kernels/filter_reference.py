"""Torch reference of the sampling filters' floors (same signature as
:func:`~dflash.kernels.filter.filter_floors`), for logits of any floating dtype.

Every filter keeps a prefix of one order of the row's tokens: their logits ``l =
float32(logits) + 0.0`` (so ``-0.0`` is ``+0.0``) descending, then token id ascending. The
floor ``(floor, floor_id)`` of a prefix is its last token's logit and id; a token ``v`` is
kept when ``l_v > floor``, or ``l_v == floor`` and ``v <= floor_id``.

- **top-k**: the first ``k`` tokens (off when ``k`` is 0 or at least the vocabulary).
- **top-p**: with ``s = l * inv_temperature`` (float32) and ``m`` the first token's ``s``,
  each token weighs ``w_v = floor(exp(float64(s_v - m)) * 2**32)``, an int64 (a NaN
  difference counts as 0, a positive one as 0). ``Z`` is the sum of the weights of what
  top-k kept (or of the row). Walking the prefix in order, a token is kept while the
  weights before it sum below ``float32(top_p) * Z`` (a float64 product); at least one
  token is kept. The
  sums are integers, so their value does not depend on the order they are added in.
- **min-p**: the tokens with ``s_v >= m + float32(log(min_p))`` (float32): the floor is
  the smallest such logit, with id ``V - 1``.

The three floors combine into the one that keeps the shortest prefix.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

#: the low 32 bits of an order key: ``_LOW - token id``
_LOW = (1 << 32) - 1
#: the fixed-point scale of a top-p weight: the first token weighs exactly this
WEIGHT_ONE = float(1 << 32)


def order_keys(l: Tensor) -> Tensor:
    """``[T, V]`` int64 keys, distinct, ordered as the tokens by ``l`` descending, then id:
    the float32 bits mapped to an order-preserving int32 (negative values' magnitude bits
    flipped) in the high half, ``2**32 - 1 - id`` in the low half. ``l`` holds no -0.0."""
    bits = l.view(torch.int32)
    ordered = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(torch.int64)
    ids = torch.arange(l.shape[-1], device=l.device, dtype=torch.int64)
    return ordered * (1 << 32) + (_LOW - ids)


def top_p_weights(s: Tensor, m: Tensor) -> Tensor:
    """``floor(exp(float64(s - m)) * 2**32)`` as int64, ``s - m`` in float32 with a NaN
    or positive difference taken as 0 (so a weight lies in ``[0, 2**32]``)."""
    d = s - m
    d = torch.where(torch.isnan(d), 0.0, d).clamp(max=0.0)
    return torch.floor(torch.exp(d.to(torch.float64)) * WEIGHT_ONE).to(torch.int64)


def top_p_table_reference(
    top: Tensor, inv_temperature: float, dtype: torch.dtype, log_min_p: float | None = None,
    buckets: int = 64,
) -> Tensor:
    """What top-p needs of each 16-bit pattern of ``dtype`` (bfloat16 or float16), for rows
    whose largest logit is ``top`` (``[T]`` float32): ``[T, 65536]`` int64 entries indexed
    by the pattern's bits, as the Triton filters gather them. Bits 0-39: the pattern's
    top-p weight (:func:`top_p_weights` of ``s = l * inv_temperature`` against ``m = top *
    inv_temperature``); bits 40-45: its bucket, ``floor(min(max(m - s, 0) * (buckets /
    22.25), buckets - 1))`` in float32 (a NaN difference as 0): equal slices of the 22.25
    below the top, past which every weight is 0; bit 48 (with ``log_min_p``): min-p keeps
    it (``s >= m + log_min_p`` in float32)."""
    patterns = torch.arange(1 << 16, dtype=torch.int32, device=top.device)
    l = patterns.to(torch.int16).view(dtype).to(torch.float32) + 0.0  # -0.0 is +0.0
    s = (l * inv_temperature)[None, :]
    m = (top.to(torch.float32) * inv_temperature)[:, None]
    d = s - m
    d = torch.where(torch.isnan(d), 0.0, d)
    slope = float(torch.tensor(buckets / 22.25, dtype=torch.float32))
    k = torch.floor(torch.clamp(torch.clamp(-d, min=0.0) * slope, max=buckets - 1.0))
    entry = top_p_weights(s, m) | (k.to(torch.int64) << 40)
    if log_min_p is not None:
        low = m + float(torch.tensor(log_min_p, dtype=torch.float32))
        entry |= (s >= low).to(torch.int64) << 48
    return entry


def stricter(a: tuple[Tensor, Tensor], b: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
    """Row by row, the floor that keeps the shorter prefix (a higher logit, or the same
    logit and a lower id)."""
    take_b = (b[0] > a[0]) | ((b[0] == a[0]) & (b[1] < a[1]))
    return torch.where(take_b, b[0], a[0]), torch.where(take_b, b[1], a[1])


def filter_floors_reference(
    logits: Tensor,
    inv_temperature: float,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
    *,
    out: tuple[Tensor, Tensor] | None = None,
) -> tuple[Tensor, Tensor]:
    """``(floor [T] float32, floor_id [T] int64)`` of ``logits: [T, V]`` (any float
    dtype) under the filters; every operation is per row or exact, so a row's floor never
    depends on the other rows. No value is read back to the host."""
    T, V = logits.shape
    l = logits.to(torch.float32) + 0.0  # -0.0 becomes +0.0
    floor = torch.full((T,), -math.inf, dtype=torch.float32, device=l.device)
    floor_id = torch.full((T,), V - 1, dtype=torch.int64, device=l.device)
    use_k = 0 < top_k < V
    if use_k or top_p < 1.0:
        # the kept prefix in order: [T, k] (top-k: the k largest keys), or the whole row
        # (top-p alone: a stable sort, whose ties keep the ids' order)
        if use_k:
            ranked = torch.topk(order_keys(l), top_k, dim=-1).values
            order = _LOW - (ranked & _LOW)  # [T, k] the token ids, in order
            lv = l.gather(1, order)  # [T, k] their logits, descending
        else:
            lv, order = torch.sort(l, dim=-1, descending=True, stable=True)
        n = torch.full((T,), lv.shape[1], dtype=torch.int64, device=l.device)
        if top_p < 1.0:
            s = lv * inv_temperature
            w = top_p_weights(s, s[:, :1])
            before = torch.cumsum(w, dim=-1) - w  # exclusive prefix, exact in int64
            top_p32 = float(torch.tensor(top_p, dtype=torch.float32))
            target = top_p32 * w.sum(-1).to(torch.float64)
            n = (before.to(torch.float64) < target[:, None]).sum(-1).clamp(min=1)
        last = (n - 1)[:, None]
        floor, floor_id = lv.gather(1, last)[:, 0], order.gather(1, last)[:, 0]
    if min_p > 0.0:
        s = l * inv_temperature
        m = l.max(-1).values * inv_temperature
        low = m + float(torch.tensor(math.log(min_p), dtype=torch.float32))  # no copy
        smallest = torch.where(s >= low[:, None], l, math.inf).min(-1).values
        floor, floor_id = stricter(
            (floor, floor_id), (smallest, torch.full_like(floor_id, V - 1))
        )
    if out is None:
        return floor, floor_id
    out[0].copy_(floor)
    out[1].copy_(floor_id)
    return out
