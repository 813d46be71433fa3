"""The one sampling rule of every decoder: a token is a deterministic function of
``(seed, absolute position, the model's logits at that position)``.

The token at position ``p`` is ``argmax_v (s_v + G(seed, p, v))`` over the vocabulary the
filters leave, where ``s = l · (1/T)`` are the logits at ``p`` scaled in float32 (the
reciprocal of the temperature rounded to float32) and ``G`` is standard Gumbel noise,
``-log(-log(u))``, from a uniform ``u`` that a counter-based generator derives from
``(seed, p, v)`` alone (Philox4x32 with 10 rounds, keyed by the seed, counter ``(v, p, 0,
0)``). The filters — top-k, then top-p on the softmax of what top-k left, then min-p —
each keep a prefix of the tokens ordered by logit descending, then token id
(:func:`filter_floors`). ``T = 0`` is greedy: the argmax of the logits.

So a one-row decode and row ``i`` of a verify that computes the same logits (M-invariant
kernels) draw the same token at the same position: plain sampled decoding is the oracle,
and a speculative step that accepts a drafted token exactly when it equals the target's
sampled token emits plain sampled decoding's text, seed for seed, bit for bit. Gumbel-max
draws token ``v`` with probability ``softmax(s)_v`` over the kept tokens.

Every operation is elementwise, an exact comparison or maximum, an integer sum, or a
sort, so a row's token never depends on how many rows the call holds. Everything runs on
the logits' device without a host read: on CUDA the draw is one Triton kernel pair
(:func:`~dflash.kernels.gumbel_argmax`) and the filters' floors a Triton histogram of the
16-bit logits (:func:`~dflash.kernels.filter_floors`), on CPU their torch references —
the same functions in a plain decode, a verify and a drafter's coupled guesses.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from dflash.errors import UsageError
from dflash.kernels.checks import Backend
from dflash.kernels.filter import filter_floors as kernel_filter_floors
from dflash.kernels.sample import gumbel_argmax
from dflash.kernels.sample_reference import gumbel_noise, philox

#: the smallest temperature above 0: logits scaled by ``1 / temperature`` stay finite in
#: float32 for every logit of magnitude under 3e33 (a smaller temperature would turn a
#: row's largest logits into ties at +inf, and the draw into the first of them)
MIN_TEMPERATURE = 1e-5


class SamplingError(UsageError):
    """A sampling parameter outside its range (names the parameter and the value)."""


@dataclass(frozen=True)
class SamplingParams:
    """How tokens are drawn: ``temperature`` (0 = greedy, else in
    ``[MIN_TEMPERATURE, 100]``), ``top_k`` (0 = off), ``top_p``
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
        if 0 < self.temperature < MIN_TEMPERATURE:
            raise SamplingError(
                f"'temperature' must be 0 (greedy) or at least {MIN_TEMPERATURE:g}: below it "
                f"the scaled logits overflow float32 (got {self.temperature!r})"
            )
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
    int64)`` such that row ``i`` keeps token ``v`` when its logit ``l_v > floor[i]``, or
    ``l_v == floor[i]`` and ``v <= floor_id[i]``; None when no filter is on. Every filter
    keeps a prefix of the tokens ordered by logit descending, then token id, so together
    they keep the shortest of their prefixes:

    - top-k: the first ``k`` of that order;
    - top-p: the first tokens whose exclusive running sum of ``softmax(s)`` over what top-k
      kept (the row, or its ``k`` first tokens) is below ``top_p``, in integer fixed point
      (``2**-32`` of the top token's probability), so the sum is exact in any order;
    - min-p: ``s_v >= max(s) + log(min_p)`` (probability at least ``min_p`` times the top).

    (:func:`~dflash.kernels.filter_floors`: on CUDA a histogram of the 16-bit logits in
    Triton, no sort; elsewhere, and for float32 logits, its torch reference.)"""
    vocab = logits.shape[-1]
    if not (0 < params.top_k < vocab or params.top_p < 1.0 or params.min_p > 0.0):
        return None
    return kernel_filter_floors(
        logits, inv_t, params.top_k, params.top_p, params.min_p, backend=_backend(logits)
    )


__all__ = [
    "GREEDY",
    "MIN_TEMPERATURE",
    "SamplingError",
    "SamplingParams",
    "filter_floors",
    "gumbel_noise",
    "inverse_temperature",
    "philox",
    "sample_tokens",
]
