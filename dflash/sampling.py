"""The one sampling rule of every decoder: a token is a deterministic function of
``(seed, absolute position, the model's logits at that position)``.

The token at position ``p`` is ``argmax_v (s_v + G(seed, p, v))`` over the vocabulary the
filters leave, where ``s = l · (1/T)`` are the logits at ``p`` scaled in float32 (the
reciprocal of the temperature rounded to float32) and ``G`` is standard Gumbel noise,
``-log(-log(u))``, from a uniform ``u`` that a counter-based generator derives from
``(seed, p, v)`` alone (Philox4x32 with 10 rounds, keyed by the seed, counter ``(v, p, 0,
0)``). The filters — top-k, then top-p on the softmax of what top-k left, then min-p —
each keep a prefix of the tokens ordered by ``s`` descending, then token id
(:func:`filter_floors`). ``T = 0`` is greedy: the argmax of the logits.

So a one-row decode and row ``i`` of a verify that computes the same logits (M-invariant
kernels) draw the same token at the same position: plain sampled decoding is the oracle,
and a speculative step that accepts a drafted token exactly when it equals the target's
sampled token emits plain sampled decoding's text, seed for seed, bit for bit. Gumbel-max
draws token ``v`` with probability ``softmax(s)_v`` over the kept tokens.

Every operation is elementwise, an exact comparison or maximum, a sort, or (top-p only) a
sum over one row computed by one program, so a row's token never depends on how many rows
the call holds. Everything runs on the logits' device without a host read: on CUDA the
draw is one Triton kernel pair (:func:`~dflash.kernels.gumbel_argmax`) and top-p's sums one
Triton kernel (:func:`~dflash.kernels.top_p_count`), on CPU their torch references —
the same functions in a plain decode, a verify and a drafter's coupled guesses.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from dflash.errors import UsageError
from dflash.kernels.checks import Backend
from dflash.kernels.sample import gumbel_argmax
from dflash.kernels.sample_reference import gumbel_noise, philox
from dflash.kernels.top_p import top_p_count


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


def sample_tokens(logits: Tensor, positions: Tensor | None, params: SamplingParams) -> Tensor:
    """The rule's token for every row: ``logits: [T, vocab]`` (any float dtype) whose rows
    draw the tokens at absolute ``positions: [T]`` (int64, on the logits' device; None is
    allowed when greedy) → ``[T]`` int64, on the device, without a host read.

    The filters become one floor per row (:func:`filter_floors`); the draw is
    :func:`~dflash.kernels.gumbel_argmax` (Triton on CUDA, its torch reference on CPU)."""
    if params.greedy:
        return logits.argmax(-1)
    if positions is None or positions.shape != logits.shape[:1]:
        raise ValueError(
            f"sampling at temperature {params.temperature} needs one position per row "
            f"(got {None if positions is None else tuple(positions.shape)} for "
            f"{logits.shape[0]} rows)"
        )
    inv_t = inverse_temperature(params)
    floors = filter_floors(logits, inv_t, params)
    floor, floor_id = floors if floors is not None else (None, None)
    return gumbel_argmax(logits, positions, params.seed, inv_t, floor, floor_id,
                         backend=_backend(logits))


def _backend(logits: Tensor) -> Backend:
    """The rule's kernels run Triton on CUDA and their torch references elsewhere (as the
    model's kernels on CPU), so every decoder on one device draws with the same code."""
    return "auto" if logits.is_cuda else "reference"


def inverse_temperature(params: SamplingParams) -> float:
    """``1 / temperature`` rounded to float32: the factor every row's logits are scaled by
    (a float32 multiply, the same in the kernel and in torch)."""
    return float(torch.tensor(1.0 / params.temperature, dtype=torch.float32))


def filter_floors(
    logits: Tensor, inv_t: float, params: SamplingParams
) -> tuple[Tensor, Tensor] | None:
    """The filters of ``params`` as one floor per row: ``(floor [T] float32, floor_id [T]
    int64)`` such that row ``i`` keeps token ``v`` when ``s_v > floor[i]``, or ``s_v ==
    floor[i]`` and ``v <= floor_id[i]`` (``s = float32(logits) * inv_t``); None when no
    filter is on. Every filter keeps a prefix of the tokens ordered by ``s`` descending,
    then token id, so together they keep the shortest of their prefixes:

    - top-k: the first ``k`` of that order;
    - top-p: the first tokens whose exclusive running sum of ``softmax(s)`` over what top-k
      kept (the row, or its ``k`` first tokens), summed in that order, is below ``top_p``
      (:func:`~dflash.kernels.top_p_count`);
    - min-p: ``s_v >= max(s) + log(min_p)`` (probability at least ``min_p`` times the top).

    The order is exact: top-k selects the ``k`` largest of one distinct int64 key per
    token (:func:`_order_keys`), top-p alone sorts the scores stably; top-p's sums run one
    row per program, so no row depends on the others."""
    vocab = logits.shape[-1]
    top_k = 0 < params.top_k < vocab
    if not (top_k or params.top_p < 1.0 or params.min_p > 0.0):
        return None
    s = logits.to(torch.float32) * inv_t + 0.0  # [T, V]; + 0.0: -0.0 becomes +0.0
    rows = s.shape[0]
    floor = torch.full((rows,), -math.inf, dtype=torch.float32, device=s.device)
    floor_id = torch.full((rows,), vocab - 1, dtype=torch.int64, device=s.device)
    if top_k or params.top_p < 1.0:
        # the kept prefix in order: [T, k] (top-k: the k largest keys), or the whole row
        # (top-p alone: a stable sort of the scores, whose ties keep the ids' order)
        if top_k:
            ranked = torch.topk(_order_keys(s), params.top_k, dim=-1).values
            order = _LOW - (ranked & _LOW)  # [T, k] the token ids, in order
            scores = s.gather(1, order)  # [T, k] their scores, descending
        else:
            scores, order = torch.sort(s, dim=-1, descending=True, stable=True)
        last = torch.full((rows, 1), scores.shape[1] - 1, dtype=torch.int64, device=s.device)
        if params.top_p < 1.0:
            count = top_p_count(scores.contiguous(), params.top_p, backend=_backend(s))
            last = (count - 1)[:, None]
        floor, floor_id = scores.gather(1, last)[:, 0], order.gather(1, last)[:, 0]
    if params.min_p > 0.0:
        low = s.max(-1).values + math.log(params.min_p)
        floor, floor_id = _stricter((floor, floor_id), (low, torch.full_like(floor_id, vocab)))
    return floor, floor_id


#: the low 32 bits of an order key: ``_LOW - token id``
_LOW = (1 << 32) - 1


def _order_keys(s: Tensor) -> Tensor:
    """``[T, V]`` int64 keys, distinct, ordered as the tokens by ``s`` descending, then id:
    the float32 bits mapped to an order-preserving int32 (negative values' magnitude bits
    flipped) in the high half, ``2**32 - 1 - id`` in the low half. ``s`` holds no -0.0."""
    bits = s.view(torch.int32)
    ordered = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(torch.int64)
    ids = torch.arange(s.shape[-1], device=s.device, dtype=torch.int64)
    return ordered * (1 << 32) + (_LOW - ids)


def _stricter(a: tuple[Tensor, Tensor], b: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
    """Row by row, the floor that keeps the shorter prefix (a higher value, or the same
    value and a lower id)."""
    take_b = (b[0] > a[0]) | ((b[0] == a[0]) & (b[1] < a[1]))
    return torch.where(take_b, b[0], a[0]), torch.where(take_b, b[1], a[1])


__all__ = [
    "GREEDY",
    "SamplingError",
    "SamplingParams",
    "filter_floors",
    "gumbel_noise",
    "inverse_temperature",
    "philox",
    "sample_tokens",
]
