"""Torch reference of :func:`~dflash.kernels.sample.gumbel_argmax`: the seeded Gumbel-max
draw of the sampling rule (:mod:`dflash.sampling`), and the Philox generator it keys.

``philox`` is Philox4x32 with 10 rounds, written with int64 tensors holding uint32 values
(the 32x32 -> 64-bit products built from 16-bit pieces, so no int64 product overflows);
its first output word equals Triton's ``tl.philox`` for the same key and counters, so the
kernel and this reference draw the same noise.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

_MASK32 = 0xFFFFFFFF
_KEY_A, _KEY_B = 0x9E3779B9, 0xBB67AE85  # Philox4x32 key increments (Weyl constants)
_ROUND_A, _ROUND_B = 0xD2511F53, 0xCD9E8D57  # Philox4x32 round multipliers
_ROUNDS = 10


def _mulhilo(a: int, b: Tensor) -> tuple[Tensor, Tensor]:
    """``(hi, lo)`` 32-bit halves of the 64-bit product of the constant ``a`` and ``b``
    (uint32 values held in int64), from 16-bit pieces so no int64 product overflows."""
    a_lo, a_hi = a & 0xFFFF, a >> 16
    b_lo, b_hi = b & 0xFFFF, b >> 16
    p0, p1, p2, p3 = a_lo * b_lo, a_lo * b_hi, a_hi * b_lo, a_hi * b_hi
    mid = (p0 >> 16) + (p1 & 0xFFFF) + (p2 & 0xFFFF)
    lo = ((mid & 0xFFFF) << 16) | (p0 & 0xFFFF)
    hi = (p3 + (p1 >> 16) + (p2 >> 16) + (mid >> 16)) & _MASK32
    return hi, lo


def philox(seed: int, c0: Tensor, c1: Tensor) -> Tensor:
    """Philox4x32-10's first output word for counters ``(c0, c1, 0, 0)`` (int64 tensors of
    uint32 values, broadcast together) under the key ``(seed mod 2**32, seed >> 32)``; a
    uint32 value in an int64 tensor."""
    k0, k1 = seed & _MASK32, (seed >> 32) & _MASK32
    x0 = (c0 & _MASK32) + 0 * c1  # both counters broadcast to one shape
    x1 = (c1 & _MASK32) + 0 * c0
    x2 = torch.zeros_like(x0)
    x3 = torch.zeros_like(x0)
    for _ in range(_ROUNDS):
        hi_b, lo_b = _mulhilo(_ROUND_B, x2)
        hi_a, lo_a = _mulhilo(_ROUND_A, x0)
        x0, x1, x2, x3 = hi_b ^ x1 ^ k0, lo_b, hi_a ^ x3 ^ k1, lo_a
        k0, k1 = (k0 + _KEY_A) & _MASK32, (k1 + _KEY_B) & _MASK32
    return x0


def gumbel_noise(seed: int, positions: Tensor, vocab: int) -> Tensor:
    """``G(seed, p, v)`` for every row's position ``p`` (``positions: [T]`` int64, taken
    mod ``2**32``) and token ``v < vocab``: ``[T, vocab]`` float32 standard Gumbel noise,
    always finite. The uniform is ``(top 23 bits of Philox + 0.5) / 2**23``: exact in
    float32, at least ``2**-24`` and at most ``1 - 2**-24`` (the float32 just below 1), so
    neither logarithm meets 0."""
    v = torch.arange(vocab, dtype=torch.int64, device=positions.device)
    return gumbel_noise_at(seed, positions, v[None, :])


def gumbel_noise_at(seed: int, positions: Tensor, ids: Tensor) -> Tensor:
    """:func:`gumbel_noise` at chosen tokens only: ``G(seed, positions[i], ids[i, c])``
    for ``positions: [T]`` and ``ids: [T, k]`` (or ``[1, k]``, the same for every row),
    ``[T, k]`` float32, bit for bit the full table's entries."""
    bits = philox(seed, ids.to(torch.int64), positions[:, None].to(torch.int64))
    u = ((bits >> 9).to(torch.float32) + 0.5) * (1.0 / (1 << 23))
    return -torch.log(-torch.log(u))


def gumbel_argmax_reference(
    logits: Tensor,
    positions: Tensor,
    seed: int,
    inv_temperature: float,
    floor: Tensor | None = None,
    floor_id: Tensor | None = None,
    *,
    out: Tensor | None = None,
) -> Tensor:
    """Row ``i``'s token ``argmax_v (s_v + G(seed, positions[i], v))`` over the kept
    tokens, ``s = float32(logits) * float32(inv_temperature)``; kept: every token, or with
    ``floor`` / ``floor_id`` those whose logit ``l_v = float32(logits)`` has ``l_v >
    floor[i]``, or ``l_v == floor[i]`` and ``v <= floor_id[i]``. The first maximum wins;
    a NaN ranks as ``+inf``."""
    vocab = logits.shape[-1]
    l = logits.to(torch.float32)
    noisy = l * inv_temperature + gumbel_noise(seed, positions, vocab)
    if floor is not None and floor_id is not None:
        ids = torch.arange(vocab, device=logits.device)[None, :]
        f, fid = floor[:, None].to(torch.float32), floor_id[:, None]
        keep = (l > f) | ((l == f) & (ids <= fid))
        noisy = torch.where(keep, noisy, -math.inf)
    noisy = torch.where(torch.isnan(noisy), math.inf, noisy)
    tokens = noisy.argmax(-1)
    if out is None:
        return tokens
    return out.copy_(tokens)
