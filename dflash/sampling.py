"""The one sampling rule of every decoder: a token is a deterministic function of
``(seed, absolute position, the model's logits at that position)``.

The token at position ``p`` is ``argmax_v (l_v / T + G(seed, p, v))`` over the vocabulary
the filters leave (top-k, then top-p, then min-p, each on the softmax of what the previous
one left), where ``l`` are the logits at ``p`` and ``G`` is standard Gumbel noise,
``-log(-log(u))``, from a uniform ``u`` that a counter-based generator derives from
``(seed, p, v)`` alone (Philox4x32 with 10 rounds, keyed by the seed, counter ``(v, p, 0,
0)``). ``T = 0`` is greedy: the argmax of the logits.

So a one-row decode and row ``i`` of a verify that computes the same logits (M-invariant
kernels) draw the same token at the same position: plain sampled decoding is the oracle,
and a speculative step that accepts a drafted token exactly when it equals the target's
sampled token emits plain sampled decoding's text, seed for seed, bit for bit. Gumbel-max
draws token ``v`` with probability ``softmax(l / T)_v`` over the kept tokens.

Every operation is elementwise, an exact comparison, or (top-p only) a reduction over one
row computed by itself, so a row's token never depends on how many rows the call holds.
Everything runs on the logits' device without a host read.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from dflash.errors import UsageError

_MASK32 = 0xFFFFFFFF
_KEY_A, _KEY_B = 0x9E3779B9, 0xBB67AE85  # Philox4x32 key increments (Weyl constants)
_ROUND_A, _ROUND_B = 0xD2511F53, 0xCD9E8D57  # Philox4x32 round multipliers
_ROUNDS = 10


class SamplingError(UsageError):
    """A sampling parameter outside its range (names the parameter and the value)."""


@dataclass(frozen=True)
class SamplingParams:
    """How tokens are drawn: ``temperature`` (0 = greedy), ``top_k`` (0 = off), ``top_p``
    (1 = off), ``min_p`` (0 = off) and the ``seed`` of the noise (an int in ``[0, 2**63)``).
    Every value is checked at construction (:class:`SamplingError`)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        def number(name: str, value: object, lo: float, hi: float, lo_open: bool) -> None:
            ok = (
                isinstance(value, (int, float)) and not isinstance(value, bool)
                and math.isfinite(value) and (lo < value if lo_open else lo <= value)
                and value <= hi
            )
            if not ok:
                bound = "(" if lo_open else "["
                raise SamplingError(
                    f"'{name}' must be a number in {bound}{lo}, {hi}] (got {value!r})"
                )

        number("temperature", self.temperature, 0.0, 100.0, False)
        number("top_p", self.top_p, 0.0, 1.0, True)
        number("min_p", self.min_p, 0.0, 1.0, False)
        for name, value, hi in (("top_k", self.top_k, 2**31 - 1), ("seed", self.seed, 2**63 - 1)):
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= hi:
                raise SamplingError(f"'{name}' must be an int in [0, {hi}] (got {value!r})")

    @property
    def greedy(self) -> bool:
        """Temperature 0: the argmax, no noise and no filter."""
        return self.temperature == 0


GREEDY = SamplingParams()


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
    """``G(seed, p, v)`` for every row's position ``p`` (``positions: [T]`` int64) and
    token ``v < vocab``: ``[T, vocab]`` float32 standard Gumbel noise, always finite. The
    uniform is ``(top 23 bits of Philox + 0.5) / 2**23``: exact in float32, at least
    ``2**-24`` and at most ``1 - 2**-24`` (the float32 just below 1), so neither
    logarithm meets 0."""
    v = torch.arange(vocab, dtype=torch.int64, device=positions.device)
    bits = philox(seed, v[None, :], positions[:, None].to(torch.int64))
    u = ((bits >> 9).to(torch.float32) + 0.5) * (1.0 / (1 << 23))
    return -torch.log(-torch.log(u))


def sample_tokens(logits: Tensor, positions: Tensor | None, params: SamplingParams) -> Tensor:
    """The rule's token for every row: ``logits: [T, vocab]`` (any float dtype) whose rows
    draw the tokens at absolute ``positions: [T]`` (int64, on the logits' device; None is
    allowed when greedy) → ``[T]`` int64, on the device, without a host read."""
    if params.greedy:
        return logits.argmax(-1)
    if positions is None or positions.shape != logits.shape[:1]:
        raise ValueError(
            f"sampling at temperature {params.temperature} needs one position per row "
            f"(got {None if positions is None else tuple(positions.shape)} for "
            f"{logits.shape[0]} rows)"
        )
    scaled = logits.to(torch.float32) / params.temperature  # [T, V]
    vocab = scaled.shape[-1]
    keep = torch.ones_like(scaled, dtype=torch.bool)
    if 0 < params.top_k < vocab:  # the k largest; ties at the boundary broken by token id
        order = torch.sort(scaled, dim=-1, descending=True, stable=True).indices
        keep = torch.zeros_like(keep).scatter_(-1, order[:, : params.top_k], True)
    if params.top_p < 1.0:
        keep = keep & _top_p(torch.where(keep, scaled, -math.inf), params.top_p)
    if params.min_p > 0.0:  # p_v >= min_p * p_max, i.e. s_v - s_max >= log(min_p)
        kept = torch.where(keep, scaled, -math.inf)
        top = kept.max(-1, keepdim=True).values
        keep = keep & (kept - top >= math.log(params.min_p))
    noisy = torch.where(keep, scaled + gumbel_noise(params.seed, positions, vocab), -math.inf)
    return noisy.argmax(-1)


def _top_p(scaled: Tensor, top_p: float) -> Tensor:
    """The smallest set of most probable tokens whose probability reaches ``top_p`` (the
    most probable always kept; ties ordered by token id), one row at a time so each row's
    sums never depend on the others."""
    keep = torch.zeros_like(scaled, dtype=torch.bool)
    for i in range(scaled.shape[0]):
        row = scaled[i : i + 1]
        probs = torch.softmax(row, dim=-1)
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True, stable=True)
        before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs  # mass ahead of each
        keep[i].scatter_(-1, order[0], (before < top_p)[0])
    return keep
