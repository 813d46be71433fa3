"""Public entry point: the seeded Gumbel-max draw of the sampling rule, one token per row
(two launches, no host read; :mod:`dflash.sampling` computes the filters' floors)."""

from __future__ import annotations

import math

import torch

from dflash.errors import KernelBoundsError
from dflash.kernels import checks
from dflash.kernels.sample_reference import gumbel_argmax_reference

#: the largest vocabulary the reduction's one program per row covers
MAX_VOCAB = 1 << 21
MAX_SEED = (1 << 63) - 1


def gumbel_argmax(
    logits: torch.Tensor,
    positions: torch.Tensor,
    seed: int,
    inv_temperature: float,
    floor: torch.Tensor | None = None,
    floor_id: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,
    backend: checks.Backend = "auto",
) -> torch.Tensor:
    """Row ``i``'s token ``argmax_v (s_v + G(seed, positions[i], v))`` over its kept
    tokens, where ``s = float32(logits) * inv_temperature`` (float32 multiply) and ``G``
    is standard Gumbel noise from Philox4x32-10 keyed by ``seed`` with counter
    ``(v, positions[i] mod 2**32, 0, 0)``.

    Args:
        logits: ``[T, V]`` floating tensor, ``1 <= V <= 2**21``, contiguous rows.
        positions: ``[T]`` int64, the absolute position each row draws.
        seed: an int in ``[0, 2**63)``.
        inv_temperature: a positive finite float (``1 / temperature``, used as float32).
        floor, floor_id: both None (every token kept) or ``[T]`` float32 and ``[T]``
            int64: row ``i`` keeps ``v`` when its logit ``l_v = float32(logits[i, v])``
            has ``l_v > floor[i]``, or ``l_v == floor[i]`` and ``v <= floor_id[i]`` (a
            prefix of the tokens ordered by logit descending, then id:
            :func:`~dflash.kernels.filter_floors`).
        out: None or a contiguous ``[T]`` int64 tensor that receives the tokens.
        backend: ``"auto"``, ``"triton"`` or ``"reference"`` (see ``gdn_verify``).

    Returns:
        ``[T]`` int64 tokens (``out`` when given): the first maximum of each row, a NaN
        ranking as ``+inf``.

    Raises:
        TypeError: an argument is not a tensor.
        KernelBoundsError: shapes, dtypes, devices, the seed, the temperature or ``out``
            are wrong (a ``ValueError``).
    """
    logits = checks.tensor("logits", logits, 2)
    T, V = logits.shape
    if T < 1 or not 1 <= V <= MAX_VOCAB:
        raise KernelBoundsError(
            f"'logits' must be [T, V] with T >= 1 and 1 <= V <= {MAX_VOCAB} "
            f"(got {tuple(logits.shape)})"
        )
    if logits.stride(-1) != 1 or logits.stride(0) != V:
        logits = logits.contiguous()
    positions = checks.index_vector("positions", positions)
    checks.shape("positions", positions, (T,), "[T] with T from logits")
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_SEED:
        raise KernelBoundsError(f"'seed' must be an int in [0, {MAX_SEED}] (got {seed!r})")
    if isinstance(inv_temperature, bool) or not isinstance(inv_temperature, (int, float)) or not (
        math.isfinite(inv_temperature) and inv_temperature > 0
    ):
        raise KernelBoundsError(
            f"'inv_temperature' must be a positive finite float (got {inv_temperature!r})"
        )
    if (floor is None) != (floor_id is None):
        raise KernelBoundsError("'floor' and 'floor_id' must be given together (got one)")
    if floor is not None and floor_id is not None:
        floor = checks.tensor_of("floor", floor, 1, torch.float32)
        checks.shape("floor", floor, (T,), "[T] with T from logits")
        floor_id = checks.index_vector("floor_id", floor_id)
        checks.shape("floor_id", floor_id, (T,), "[T] with T from logits")
    named: dict[str, torch.Tensor | None] = {
        "logits": logits, "positions": positions, "floor": floor, "floor_id": floor_id
    }
    if out is not None:
        out = checks.output("out", out, (T,), torch.int64, "[T] with T from logits")
        checks.disjoint("out", out, named)
    device = checks.same_device({**named, "out": out})
    if checks.use_triton(backend, device):
        from dflash.kernels.sample_triton import launch_gumbel_argmax

        target = torch.empty(T, dtype=torch.int64, device=device) if out is None else out
        return launch_gumbel_argmax(
            logits, positions.contiguous(), seed, float(inv_temperature),
            None if floor is None else floor.contiguous(),
            None if floor_id is None else floor_id.contiguous(), target,
        )
    return gumbel_argmax_reference(
        logits, positions, seed, float(inv_temperature), floor, floor_id, out=out
    )
