"""The seeded Gumbel-max draw (``gumbel_argmax``): Triton (interpreter) against the torch
reference, rows independent of the call, every output written, floors respected, and
argument checks."""

from __future__ import annotations

import math

import pytest
import torch
from kernels_support import needs_interpreter

from dflash.errors import KernelBoundsError
from dflash.kernels import gumbel_argmax, gumbel_argmax_reference
from dflash.kernels.sample_reference import gumbel_noise

POISON = -7  # an int64 output cannot hold NaN: a row the kernel leaves keeps this


def poisoned(rows: int) -> torch.Tensor:
    return torch.full((rows,), POISON, dtype=torch.int64)


def margins(logits: torch.Tensor, positions: torch.Tensor, seed: int, inv_t: float,
            keep: torch.Tensor | None = None) -> torch.Tensor:
    """Per row, the gap between the best and second-best noisy score (float64): rows
    whose gap is a few ulps may differ between two correct logarithms."""
    noisy = (logits.float() * inv_t).double() + gumbel_noise(seed, positions,
                                                             logits.shape[1]).double()
    if keep is not None:
        noisy = torch.where(keep, noisy, -math.inf)
    if noisy.shape[1] == 1:
        return torch.full((noisy.shape[0],), math.inf, dtype=torch.float64)
    top2 = noisy.topk(2, dim=-1).values
    return top2[:, 0] - top2[:, 1]


def floors_from(logits: torch.Tensor, inv_t: float, keep_n: list[int]) -> tuple[torch.Tensor, ...]:
    """Floors keeping the first ``keep_n[i]`` tokens of row ``i`` in (logit desc, id)
    order, and the kept mask (a floor is a logit: ``inv_t`` does not change the order)."""
    l = logits.float()
    order = torch.sort(l, dim=-1, descending=True, stable=True).indices
    last = torch.tensor(keep_n)[:, None] - 1
    floor_id = order.gather(1, last)[:, 0]
    floor = l.gather(1, floor_id[:, None])[:, 0]
    ids = torch.arange(l.shape[1])[None]
    keep = (l > floor[:, None]) | ((l == floor[:, None]) & (ids <= floor_id[:, None]))
    return floor, floor_id, keep


@needs_interpreter
@pytest.mark.parametrize("V", [1, 7, 2047, 2048, 2049, 6000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("filtered", [False, True])
def test_triton_matches_reference(V: int, dtype: torch.dtype, filtered: bool) -> None:
    gen = torch.Generator().manual_seed(V)
    logits = (torch.randn(6, V, generator=gen) * 3).to(dtype)
    positions = torch.tensor([0, 1, 17, 4096, 2**31 + 5, 2**32 - 1])
    seed, inv_t = 2**40 + V, float(torch.tensor(1 / 0.7, dtype=torch.float32))
    floor = floor_id = keep = None
    if filtered:
        floor, floor_id, keep = floors_from(logits, inv_t, [min(V, n) for n in (1, 2, 5, 40, V, 3)])
    out = poisoned(6)
    got = gumbel_argmax(logits, positions, seed, inv_t, floor, floor_id, out=out,
                        backend="triton")
    ref = gumbel_argmax_reference(logits, positions, seed, inv_t, floor, floor_id)
    assert got is out and (got != POISON).all()
    clear = margins(logits, positions, seed, inv_t, keep) > 1e-5
    assert clear.sum() >= 5
    assert torch.equal(got[clear], ref[clear])
    if keep is not None:
        assert keep.gather(1, got[:, None]).all()


@needs_interpreter
def test_rows_do_not_depend_on_the_call() -> None:
    """A row's token is the same bits alone or among 9 rows, with and without a floor."""
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(9, 3000, generator=gen).to(torch.bfloat16)
    positions = torch.arange(500, 509)
    floor, floor_id, _ = floors_from(logits, 1.25, [3, 10, 1, 3000, 7, 50, 2, 2, 900])
    for f, fid in ((None, None), (floor, floor_id)):
        together = gumbel_argmax(logits, positions, 3, 1.25, f, fid, out=poisoned(9),
                                 backend="triton")
        for r in range(9):
            alone = gumbel_argmax(
                logits[r : r + 1], positions[r : r + 1], 3, 1.25,
                None if f is None else f[r : r + 1], None if fid is None else fid[r : r + 1],
                out=poisoned(1), backend="triton",
            )
            assert int(alone) == int(together[r]), r


@needs_interpreter
@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_edge_rows(backend: str) -> None:
    """A row of -inf draws token 0 (the first maximum); a NaN ranks as +inf; a floor at
    -inf with the last id keeps everything; only the floor's tied tokens up to its id are
    kept."""
    logits = torch.zeros(4, 2500)
    logits[0] = -math.inf
    logits[1, 2300] = math.nan
    logits[3, :] = 1.0  # every token tied: the floor keeps ids 0 … 4
    positions = torch.arange(4)
    got = gumbel_argmax(logits, positions, 0, 1.0, backend=backend)  # type: ignore[arg-type]
    assert got[:2].tolist() == [0, 2300]
    floor = torch.tensor([-math.inf, -math.inf, -math.inf, 1.0])
    floor_id = torch.tensor([2499, 2499, 2499, 4])
    seen = set()
    for seed in range(40):
        got = gumbel_argmax(logits, positions, seed, 1.0, floor, floor_id,
                            backend=backend)  # type: ignore[arg-type]  # a literal
        seen.add(int(got[3]))
    assert seen == {0, 1, 2, 3, 4}


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        ({"logits": [[1.0]]}, TypeError, "'logits' must be a torch.Tensor"),
        ({"logits": torch.zeros(3)}, KernelBoundsError, "'logits' must have 2 dimensions"),
        ({"logits": torch.zeros(2, 4, dtype=torch.int64)}, KernelBoundsError,
         "'logits' must be a floating tensor"),
        ({"logits": torch.zeros(0, 4), "positions": torch.zeros(0, dtype=torch.int64)},
         KernelBoundsError, r"'logits' must be \[T, V\] with T >= 1"),
        ({"positions": torch.zeros(2)}, KernelBoundsError, "'positions' must be a one-dim"),
        ({"positions": torch.zeros(3, dtype=torch.int64)}, KernelBoundsError,
         r"'positions' must have shape \[T\]"),
        ({"seed": -1}, KernelBoundsError, r"'seed' must be an int in \[0, "),
        ({"seed": 2**63}, KernelBoundsError, "'seed'"),
        ({"seed": True}, KernelBoundsError, "'seed'"),
        ({"inv_temperature": 0.0}, KernelBoundsError, "'inv_temperature' must be a positive"),
        ({"inv_temperature": math.inf}, KernelBoundsError, "'inv_temperature'"),
        ({"floor": torch.zeros(2)}, KernelBoundsError, "'floor' and 'floor_id' must be given"),
        ({"floor": torch.zeros(2, dtype=torch.float64),
          "floor_id": torch.zeros(2, dtype=torch.int64)}, KernelBoundsError,
         "'floor' must be a 1-dimensional torch.float32"),
        ({"floor": torch.zeros(3), "floor_id": torch.zeros(3, dtype=torch.int64)},
         KernelBoundsError, r"'floor' must have shape \[T\]"),
        ({"out": torch.zeros(2, dtype=torch.int32)}, KernelBoundsError,
         "'out' must be torch.int64"),
        ({"out": torch.zeros(3, dtype=torch.int64)}, KernelBoundsError, r"'out' must have shape"),
        ({"backend": "cuda"}, KernelBoundsError, "'backend' must be"),
    ],
)
def test_bad_arguments_are_named(
    change: dict[str, object], error: type[Exception], match: str
) -> None:
    args: dict[str, object] = {
        "logits": torch.zeros(2, 4), "positions": torch.zeros(2, dtype=torch.int64),
        "seed": 0, "inv_temperature": 1.0, "floor": None, "floor_id": None,
    }
    kwargs: dict[str, object] = {}
    for name, value in change.items():
        (kwargs if name in ("out", "backend") else args)[name] = value
    with pytest.raises(error, match=match):
        gumbel_argmax(**args, **kwargs)  # type: ignore[arg-type]  # bad values on purpose
