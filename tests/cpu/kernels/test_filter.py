"""The filters' floors: the Triton histogram (interpreter) against the torch reference on
16-bit logits full of ties, rows that do not depend on the call, every output written,
and the arguments' checks."""

from __future__ import annotations

import math

import pytest
import torch
from kernels_support import NAN, needs_interpreter

from dflash.errors import KernelBoundsError
from dflash.kernels import filter_floors, filter_floors_reference
from dflash.kernels.filter_reference import top_p_table_reference
from dflash.kernels.filter_triton import CHUNK, GROUPS, NBINS

SENTINEL = -7  # an int64 output cannot hold NaN: an id the kernel does not write stays -7

#: (top_k, top_p, min_p): each filter alone, every pair, all three, and extremes (top-k
#: of 1, a nucleus of one token, a nucleus of nearly everything, min-p of 1, a min-p floor
#: below every bin the histogram counts)
FILTERS = [
    (5, 1.0, 0.0), (1, 1.0, 0.0), (0, 0.9, 0.0), (0, 1e-6, 0.0), (0, 0.9999, 0.0),
    (0, 1.0, 0.1), (0, 1.0, 1.0), (40, 0.7, 0.0), (40, 1.0, 0.05), (0, 0.8, 0.2),
    (20, 0.95, 0.02), (0, 0.9, 1e-12), (5, 1.0, 1e-12),
]


def hostile_rows(V: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """``[6, V]`` logits: wide and narrow random rows, a row of one value, a row whose top
    value ties across chunk boundaries, both signs of zero with ``-inf`` entries, and huge
    values (which a small temperature scales to infinity)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(6, V, generator=gen)
    x[0] *= 8.0
    x[1] *= 0.25
    x[2] = 1.5
    x[3] = torch.randint(-4, 4, (V,), generator=gen).float()  # 8 values: ties everywhere
    x[4] = torch.randint(-1, 2, (V,), generator=gen).float() * 0.0  # -0.0 and +0.0
    x[4, :: max(1, V // 7)] = -math.inf
    x[4, V // 2] = 0.5
    x[5] = x[5] * 3e4
    return x.to(dtype)


def run_triton(
    logits: torch.Tensor, inv_t: float, k: int, p: float, mp: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton floors into poisoned outputs, checked to be the outputs returned."""
    T = logits.shape[0]
    out = (torch.full((T,), NAN), torch.full((T,), SENTINEL, dtype=torch.int64))
    got = filter_floors(logits, inv_t, k, p, mp, out=out, backend="triton")
    assert got[0] is out[0] and got[1] is out[1]
    assert not torch.isnan(got[0]).any() and (got[1] != SENTINEL).all()
    return got


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("V", [1, 3, CHUNK + 3])
def test_triton_equals_the_reference(dtype: torch.dtype, V: int) -> None:
    """Every filter combination at temperatures 1, 0.7 and 1e-4 (which overflows the huge
    row), on rows of one token, a few tokens and more than one chunk."""
    logits = hostile_rows(V, dtype, seed=V)
    for i, (k, p, mp) in enumerate(FILTERS):
        inv_t = [1.0, 1 / 0.7, 1e4][i % 3]
        got = run_triton(logits, inv_t, k, p, mp)
        ref = filter_floors_reference(logits, float(torch.tensor(inv_t).float()), k, p, mp)
        assert torch.equal(got[0], ref[0]), (k, p, mp, got, ref)
        assert torch.equal(got[1], ref[1]), (k, p, mp, got, ref)


class _PoisonedScratch:
    """``torch`` as :mod:`dflash.kernels.filter_triton` sees it, except that every scratch
    tensor it allocates starts full of garbage (NaN, or -123,457 for integers), so a
    buffer read before a launch writes it (the histogram before its zeroing, a partial
    before its level) changes the floors."""

    def __getattr__(self, name: str) -> object:
        return getattr(torch, name)

    @staticmethod
    def empty(*shape: int, dtype: torch.dtype = torch.float32, device: object = None
              ) -> torch.Tensor:
        t: torch.Tensor = torch.empty(*shape, dtype=dtype, device=device)  # type: ignore[call-overload]  # the device as the kernels' module gives it
        return t.fill_(NAN if dtype.is_floating_point else -123_457)


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_no_scratch_is_read_before_it_is_written(
    dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Top-p alone (two mass levels folded into the launches after them), top-k, min-p and
    all three on rows of several chunks, every scratch tensor poisoned."""
    from dflash.kernels import filter_triton

    monkeypatch.setattr(filter_triton, "torch", _PoisonedScratch())
    logits = hostile_rows(CHUNK + 3, dtype, seed=5)
    for k, p, mp in [(0, 0.9, 0.0), (0, 0.8, 0.2), (40, 1.0, 0.05), (20, 0.95, 0.02)]:
        got = run_triton(logits, 1 / 0.7, k, p, mp)
        ref = filter_floors_reference(logits, float(torch.tensor(1 / 0.7).float()), k, p, mp)
        assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1]), (k, p, mp)


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("log_min_p", [None, math.log(0.05)])
def test_the_table_holds_each_patterns_weight_bucket_and_min_p_flag(
    dtype: torch.dtype, log_min_p: float | None
) -> None:
    """Top-p's table (every one of the 65,536 patterns, NaN and infinities included) equals
    its torch reference bit for bit, each row against its own top, at two temperatures;
    each row's top bin is stored."""
    from dflash.kernels import filter_triton as ft

    logits = hostile_rows(CHUNK + 3, dtype, seed=11)[:5]  # the finite rows
    T, V = logits.shape
    chunks = -(-V // CHUNK)
    maxima = torch.full((T, chunks * GROUPS), -123_457, dtype=torch.int32)
    ft.filter_maxima_kernel[(T, chunks)](
        logits.view(torch.int16), maxima, torch.empty(T, NBINS, dtype=torch.int32), V, chunks,
        BV=CHUNK, SUB=GROUPS,
    )
    top = logits.float().max(-1).values + 0.0
    for inv_t in (1.0, float(torch.tensor(1 / 0.7, dtype=torch.float32))):
        out = ft.launch_filter_nucleus(logits.view(torch.int16), maxima, inv_t, 0.9, log_min_p,
                                       dtype == torch.bfloat16)
        want = top_p_table_reference(top, inv_t, dtype, log_min_p)
        assert torch.equal(out["table"], want), inv_t
        bins = out["tops"]  # back to 16-bit float patterns
        back = torch.where(bins >= 0x8000, bins - 0x8000, 0xFFFF - bins).to(torch.int16)
        assert torch.equal(back.view(dtype).float() + 0.0, top), bins


@needs_interpreter
@pytest.mark.parametrize("top_p", [0.93, 0.99])
def test_top_p_cut_across_the_empty_bins_around_zero(top_p: float) -> None:
    """A nucleus cut in a bucket that straddles zero: ``+1e-3`` and ``-1e-3`` lie in one
    bucket, about 30,000 empty bins apart (every tiny magnitude between them), and the cut
    falls among the positive tokens (0.93) or past them, among the negative ones (0.99).
    The scan skips the empty blocks of bins and still finds the reference's floor."""
    row = torch.cat([torch.tensor([10.0]), torch.full((1000,), 1e-3),
                     torch.full((1000,), -1e-3)])
    logits = row[torch.randperm(len(row), generator=torch.Generator().manual_seed(3))]
    logits = logits[None].to(torch.bfloat16)
    got = run_triton(logits, 1.0, 0, top_p, 0.0)
    ref = filter_floors_reference(logits, 1.0, 0, top_p, 0.0)
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1]), (got, ref)
    assert (float(got[0][0]) > 0) == (top_p < 0.98), float(got[0][0])


@needs_interpreter
def test_a_rows_floor_does_not_depend_on_the_call() -> None:
    logits = hostile_rows(700, torch.bfloat16, seed=1)
    whole = run_triton(logits, 1.25, 20, 0.9, 0.01)
    for r in (0, 3, 5):
        alone = run_triton(logits[r : r + 1].clone(), 1.25, 20, 0.9, 0.01)
        assert float(alone[0][0]) == float(whole[0][r]) and int(alone[1][0]) == int(whole[1][r])


def test_the_reference_keeps_what_the_filters_define() -> None:
    """Top-k keeps exactly k tokens; top-p's kept mass reaches ``top_p`` and one token
    fewer would not; min-p's kept tokens are those within ``log(min_p)`` of the top."""
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(4, 300, generator=gen) * 3).to(torch.bfloat16)
    l = logits.float()
    ids = torch.arange(300)

    def kept(floor: torch.Tensor, floor_id: torch.Tensor) -> torch.Tensor:
        return (l > floor[:, None]) | ((l == floor[:, None]) & (ids <= floor_id[:, None]))

    assert (kept(*filter_floors_reference(logits, 1.0, 17)).sum(-1) == 17).all()
    probs = torch.softmax(l.double(), -1)
    keep = kept(*filter_floors_reference(logits, 1.0, 0, 0.8))
    for r in range(4):
        mass = float(probs[r][keep[r]].sum())
        smallest = float(probs[r][keep[r]].min())
        assert mass >= 0.8 - 1e-6 and mass - smallest < 0.8 + 1e-6
    keep = kept(*filter_floors_reference(logits, 1.0, 0, 1.0, 0.1))
    assert torch.equal(keep, l >= l.max(-1, keepdim=True).values + math.log(0.1))


def test_no_filter_keeps_every_token() -> None:
    floor, floor_id = filter_floors(torch.zeros(2, 9), 1.0, 9, 1.0, 0.0)
    assert floor.tolist() == [-math.inf] * 2 and floor_id.tolist() == [8, 8]


@pytest.mark.parametrize(("kwargs", "error", "match"), [
    ({"logits": torch.zeros(3)}, KernelBoundsError, "'logits' must have 2 dimensions"),
    ({"logits": torch.zeros(2, 4, dtype=torch.int64)}, KernelBoundsError, "floating"),
    ({"logits": torch.zeros(0, 4)}, KernelBoundsError, r"\(got \(0, 4\)\)"),
    ({"inv_temperature": 0.0}, KernelBoundsError, "'inv_temperature' must be in"),
    ({"inv_temperature": 1e39}, KernelBoundsError, "stay finite in float32"),
    ({"inv_temperature": "2"}, TypeError, "'inv_temperature' must be a number"),
    ({"top_k": -1}, KernelBoundsError, r"'top_k' must be an int >= 0 \(got -1\)"),
    ({"top_k": True}, KernelBoundsError, "'top_k'"),
    ({"top_p": 0.0}, KernelBoundsError, r"'top_p' must be in \(0.0, 1.0\] \(got 0.0\)"),
    ({"top_p": NAN}, KernelBoundsError, "'top_p'"),
    ({"min_p": 1.5}, KernelBoundsError, r"'min_p' must be in \[0.0, 1.0\] \(got 1.5\)"),
    ({"out": torch.zeros(2)}, TypeError, "'out' must be a"),
    ({"out": (torch.zeros(2), torch.zeros(2))}, KernelBoundsError,
     r"'out\[1\]' must be torch.int64"),
    ({"out": (torch.zeros(3), torch.zeros(2, dtype=torch.int64))}, KernelBoundsError,
     r"'out\[0\]'"),
    ({"backend": "triton"}, KernelBoundsError, "takes bfloat16 or float16 logits"),
    ({"backend": "fast"}, KernelBoundsError, "'backend' must be"),
])
def test_bad_arguments_are_named(
    kwargs: dict[str, object], error: type[Exception], match: str
) -> None:
    call: dict[str, object] = {"logits": torch.zeros(2, 4), "inv_temperature": 1.0,
                               "top_k": 2, **kwargs}
    with pytest.raises(error, match=match):
        filter_floors(**call)  # type: ignore[arg-type]  # wrong types on purpose
