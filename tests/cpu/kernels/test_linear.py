"""M-invariant linear: Triton (interpreter) against the reference, row invariance in M on
both backends, NaN-poisoned outputs and argument checks."""

from __future__ import annotations

import pytest
import torch
from kernels_support import NAN, needs_interpreter, rel_rms

from dflash.kernels import linear, linear_reference, linear_triton
from dflash.kernels.checks import Backend
from dflash.kernels.linear_triton import (
    LinearConfig,
    launch_linear,
    linear_config,
    linear_launch,
    m_tiles_for,
    row_tiles_for,
    wide_row_tiles,
    wide_rows_hold,
)

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
TOL = {torch.float32: 1e-6, torch.bfloat16: 1e-2, torch.float16: 2e-3}
BACKENDS = [
    "reference",
    pytest.param("triton", marks=needs_interpreter),
]


def _inputs(M: int, N: int, K: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=gen).to(dtype)
    w = (torch.randn(N, K, generator=gen) / K**0.5).to(dtype)
    b = torch.randn(N, generator=gen).to(dtype)
    return x, w, b


@needs_interpreter
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("M", "N", "K"), [(5, 45, 67), (17, 20, 1100)])
def test_triton_matches_reference(M: int, N: int, K: int, dtype: torch.dtype) -> None:
    """(17, 20, 1100) runs the split-K path (2 splits) with two 16-row tiles."""
    x, w, b = _inputs(M, N, K, dtype, seed=K)
    out = torch.full((M, N), NAN, dtype=dtype)
    got = linear(x, w, b, out=out, backend="triton")
    assert got is out and torch.isfinite(got).all()
    ref = linear_reference(x.double(), w.double(), b.double())
    assert rel_rms(got, ref) <= TOL[dtype]
    no_bias = linear(x, w, backend="triton")
    assert rel_rms(no_bias, linear_reference(x.double(), w.double())) <= TOL[dtype]


def test_split_rule_is_a_function_of_the_shape() -> None:
    assert linear_config(20, 1100, torch.bfloat16).split_k == 2
    assert linear_config(45, 67, torch.bfloat16).split_k == 1
    assert linear_config(4096, 12288, torch.bfloat16).split_k == 4


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_do_not_depend_on_M(backend: Backend, dtype: torch.dtype) -> None:
    """Row i of an M-row call is bitwise the 1-row call on that row, for M = 1..17, with
    different neighbours and positions for every M."""
    x, w, b = _inputs(17, 45, 67, dtype, seed=7)
    alone = [linear(x[i : i + 1], w, b, backend=backend)[0] for i in range(17)]
    for M in range(1, 18):
        order = [(i + 5 * M) % 17 for i in range(M)]
        got = linear(x[order], w, b, backend=backend)
        for i, src in enumerate(order):
            assert torch.equal(got[i], alone[src]), f"M={M} row {i} (source row {src})"


@needs_interpreter
def test_split_k_rows_do_not_depend_on_M() -> None:
    """The split-K path (3 splits of 2 K blocks, partials reduced in a second pass) keeps
    rows fixed too."""
    cfg = LinearConfig(block_n=16, block_k=16, split_k=3, num_warps=4, num_stages=1)
    x, w, b = _inputs(17, 21, 90, torch.float32, seed=8)
    alone = [launch_linear(x[i : i + 1], w, b, None, cfg)[0] for i in range(17)]
    for M in (1, 2, 16, 17):
        got = launch_linear(x[:M], w, b, None, cfg)
        for i in range(M):
            assert torch.equal(got[i], alone[i]), f"M={M} row {i}"
    assert rel_rms(got, linear_reference(x.double(), w.double(), b.double())) <= 1e-6


#: row counts around every boundary of the wide kernel: 1, 2, 4, 8 tiles per program
#: (16, 32, 64, 128 rows) and a second row group (129, 200)
WIDE_M = (1, 15, 16, 17, 31, 33, 64, 65, 100, 128, 129, 200)


def test_row_tiles_per_program_and_pipeline_depth() -> None:
    """M sets the tiles per program only; the stage count shrinks for wide programs and
    the tiles and split-K count (the reduction order) never move."""
    assert [m_tiles_for(M) for M in WIDE_M] == [1, 1, 1, 2, 2, 4, 4, 8, 8, 8, 8, 8]
    for dtype, stages in ((torch.bfloat16, [4, 4, 3, 2]), (torch.float16, [4, 4, 3, 2]),
                          (torch.float32, [3, 3, 3, 2])):
        cfgs = [linear_config(4096, 12288, dtype, t) for t in (1, 2, 4, 8)]
        assert [c.num_stages for c in cfgs] == stages
        assert len({(c.block_n, c.block_k, c.split_k, c.num_warps) for c in cfgs}) == 1
    with pytest.raises(ValueError, match="'m_tiles' must be a power of two in 1 … 8"):
        linear_config(64, 64, torch.float32, 3)
    with pytest.raises(ValueError, match="'M' must be >= 1 row"):
        m_tiles_for(0)


class _GridRecorder:
    """Stands in for ``linear_kernel``: records each launch grid, then launches."""

    def __init__(self, kernel: object) -> None:
        self.kernel = kernel
        self.grids: list[tuple[int, ...]] = []

    def __getitem__(self, grid: tuple[int, ...]) -> object:
        self.grids.append(tuple(grid))
        return self.kernel[grid]  # type: ignore[index]  # a Triton kernel, untyped


@needs_interpreter
def test_one_program_per_weight_tile_up_to_128_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """Up to 128 rows, the launch has one row group: ``cdiv(N, BLOCK_N) * split``
    programs, each reading its weight slice once; 129 rows take two groups."""
    N, K = 70, 600
    cfg = linear_config(N, K, torch.float32)
    assert cfg.block_n == 64 and cfg.split_k == 2
    recorder = _GridRecorder(linear_triton.linear_kernel)
    monkeypatch.setattr(linear_triton, "linear_kernel", recorder)
    x, w, _ = _inputs(129, N, K, torch.float32, seed=10)
    for M, groups in ((1, 1), (17, 1), (128, 1), (129, 2)):
        recorder.grids.clear()
        linear(x[:M], w, backend="triton")
        assert recorder.grids == [(groups, 2, 2)], f"M={M}"
        assert linear_launch(M, N, K, torch.float32).grid == (groups, 2, 2)
    assert linear_launch(64, 12288, 4096, torch.bfloat16).grid == (1, 192, 1)
    assert linear_launch(128, 4096, 12288, torch.bfloat16).grid == (1, 64, 4)


@needs_interpreter
@pytest.mark.parametrize(
    ("dtype", "split", "bias"),
    [(torch.float32, 1, True), (torch.float32, 3, False), (torch.bfloat16, 1, False),
     (torch.bfloat16, 3, True), (torch.float16, 1, True), (torch.float16, 3, False)],
)
def test_wide_rows_do_not_depend_on_M(dtype: torch.dtype, split: int, bias: bool) -> None:
    """Rows of an M-row call, taken at the front and at the back of 200 rows, are
    bitwise the same rows of the 200-row call, for M across every tile and row-group
    boundary (1, 2, 4, 8 tiles per program; a second group from 129 rows), so a row does
    not depend on M nor on its tile's place in its program. Outputs NaN-poisoned. Each
    dtype runs with split-K on and off, each split setting with and without bias."""
    cfg = LinearConfig(block_n=16, block_k=16, split_k=split, num_warps=4, num_stages=1)
    x, w, b = _inputs(200, 20, 48, dtype, seed=11 + split)
    bb = b if bias else None
    full = launch_linear(x, w, bb, torch.full((200, 20), NAN, dtype=dtype), cfg)
    want = x.double() @ w.double().T + (b.double() if bias else 0)
    assert rel_rms(full, want) <= TOL[dtype]
    for M in WIDE_M:
        for first in {0, 200 - M}:
            out = torch.full((M, 20), NAN, dtype=dtype)
            got = launch_linear(x[first : first + M], w, bb, out, cfg)
            assert torch.equal(got, full[first : first + M]), f"M={M} rows {first}.."


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_wide_rows_with_the_default_config(dtype: torch.dtype) -> None:
    """Through :func:`linear` with the shape's own config (split 2 or 4), rows of 1-,
    65- and 129-row calls are bitwise the rows of the 200-row call."""
    x, w, b = _inputs(200, 20, 1100, dtype, seed=12)
    assert linear_config(20, 1100, dtype).split_k > 1
    full = linear(x, w, b, backend="triton")
    for M in (1, 65, 129):
        for first in {0, 200 - M}:
            got = linear(x[first : first + M], w, b, backend="triton")
            assert torch.equal(got, full[first : first + M]), f"M={M} rows {first}.."


@needs_interpreter
@pytest.mark.parametrize("split", [1, 3])
def test_wide_call_into_a_column_slice(split: int) -> None:
    """A 100-row call (8 tiles, 4 of them partly or wholly past M) into a column slice
    of a wider buffer: every element written, the other columns untouched."""
    cfg = LinearConfig(block_n=16, block_k=16, split_k=split, num_warps=4, num_stages=1)
    x, w, b = _inputs(100, 20, 48, torch.float32, seed=13)
    buf = torch.full((100, 31), NAN)
    out = buf[:, 4:24]
    got = launch_linear(x, w, b, out, cfg)
    assert got is out and torch.isfinite(out).all()
    assert torch.isnan(buf[:, :4]).all() and torch.isnan(buf[:, 24:]).all()
    assert torch.equal(out, launch_linear(x, w, b, None, cfg))
    assert rel_rms(out, x.double() @ w.double().T + b.double()) <= 1e-6


@pytest.mark.parametrize("backend", BACKENDS)
def test_leading_dims_and_strided_out(backend: Backend) -> None:
    """x [2, 3, K] and out a column slice of a wider buffer: every element written, the
    rest of the buffer untouched."""
    x, w, b = _inputs(6, 33, 40, torch.float32, seed=9)
    buf = torch.full((2, 3, 50), NAN)
    out = buf[..., 5:38]
    got = linear(x.view(2, 3, 40), w, b, out=out, backend=backend)
    assert got is out and got.shape == (2, 3, 33)
    assert torch.isfinite(out).all()
    assert torch.isnan(buf[..., :5]).all() and torch.isnan(buf[..., 38:]).all()
    assert rel_rms(out.reshape(6, 33), x.double() @ w.double().T + b.double()) <= 1e-6


@pytest.mark.parametrize("backend", BACKENDS)
def test_zero_rows(backend: Backend) -> None:
    x, w, _ = _inputs(0, 8, 16, torch.float32, seed=1)
    assert linear(x, w, backend=backend).shape == (0, 8)


def test_reference_is_the_defining_formula() -> None:
    x, w, b = _inputs(4, 9, 13, torch.float64, seed=2)
    assert torch.allclose(linear_reference(x, w, b), x @ w.T + b)


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        ({"x": [1.0]}, TypeError, "'x' must be a torch.Tensor"),
        ({"x": torch.ones(2, 3, dtype=torch.int32)}, ValueError, "'x' must be a floating"),
        ({"x": torch.ones(2, 0)}, ValueError, "'x' last dimension K"),
        ({"weight": torch.ones(4, 5)}, ValueError, "'weight' must have shape"),
        ({"weight": torch.ones(4)}, ValueError, "'weight' must have 2 dimensions"),
        ({"weight": torch.ones(4, 3, dtype=torch.float64)}, ValueError, "'weight' must be"),
        ({"weight": torch.ones(3, 4).T}, ValueError, "'weight' must be contiguous along K"),
        ({"bias": torch.ones(5)}, ValueError, "'bias' must have shape"),
        ({"bias": torch.ones(4, dtype=torch.float16)}, ValueError, "'bias' must be"),
        ({"out": torch.ones(2, 5)}, ValueError, "'out' must have shape"),
        ({"out": torch.ones(2, 4, dtype=torch.float16)}, ValueError, "'out' must be"),
        ({"out": torch.ones(4, 2).T}, ValueError, "'out' must have a contiguous last"),
        ({"x": torch.ones(2, 2, 3), "out": torch.ones(2, 4, 2).transpose(1, 2)},
         ValueError, "'out' must have a contiguous last"),
        ({"x": torch.ones(2, 2, 3), "out": torch.ones(4, 2, 4).transpose(0, 1)[:, :2]},
         ValueError, "'out' leading dimensions"),
        ({"bias": torch.ones(4, device="meta")}, ValueError, "'bias' is on meta"),
        ({"backend": "cuda"}, ValueError, "'backend' must be"),
    ],
)
def test_bad_arguments_are_named(kwargs: dict[str, object], exc: type, match: str) -> None:
    args: dict[str, object] = {"x": torch.ones(2, 3), "weight": torch.ones(4, 3),
                               "bias": None, "out": None, "backend": "reference"}
    args.update(kwargs)
    with pytest.raises(exc, match=match):
        linear(args["x"], args["weight"], args["bias"], out=args["out"],  # type: ignore[arg-type]  # bad values on purpose
               backend=args["backend"])  # type: ignore[arg-type]  # as above


@needs_interpreter
def test_triton_rejects_float64() -> None:
    x, w, _ = _inputs(2, 3, 4, torch.float64, seed=3)
    with pytest.raises(ValueError, match="'x' dtype must be float16, bfloat16 or float32"):
        linear(x, w, backend="triton")


def test_wide_row_tiles_per_call() -> None:
    """Wide: one tile of the next power of two of M rows, 16 … 128, one program per
    weight tile up to 128 rows; narrow: 16-row tiles, several per program."""
    assert [row_tiles_for(M, True) for M in WIDE_M] == [
        (16, 1), (16, 1), (16, 1), (32, 1), (32, 1), (64, 1), (64, 1), (128, 1), (128, 1),
        (128, 1), (128, 1), (128, 1)]
    assert [row_tiles_for(M, False) for M in WIDE_M] == [(16, t) for t in
                                                        [1, 1, 1, 2, 2, 4, 4, 8, 8, 8, 8, 8]]
    assert linear_launch(200, 20, 48, torch.float32, wide=True).grid[0] == 2
    with pytest.raises(ValueError, match="'M' must be >= 1 row"):
        row_tiles_for(0, True)


@needs_interpreter
@pytest.mark.parametrize(("dtype", "split"), [(torch.float32, 1), (torch.float32, 3),
                                              (torch.bfloat16, 3), (torch.float16, 1)])
def test_wide_row_tiles_give_the_bits_of_16_row_tiles(dtype: torch.dtype, split: int) -> None:
    """Every row of a wide call (one 32-, 64- or 128-row MMA per weight tile) is bitwise
    the row of the same call in 16-row tiles, at every tile and row-group boundary.
    Outputs NaN-poisoned."""
    cfg = LinearConfig(block_n=16, block_k=16, split_k=split, num_warps=4, num_stages=1)
    x, w, b = _inputs(200, 20, 48, dtype, seed=21 + split)
    for M in WIDE_M:
        narrow = launch_linear(x[:M], w, b, torch.full((M, 20), NAN, dtype=dtype), cfg,
                               wide=False)
        wide = launch_linear(x[:M], w, b, torch.full((M, 20), NAN, dtype=dtype), cfg,
                             wide=True)
        assert torch.isfinite(wide).all()
        assert torch.equal(wide, narrow), f"M={M}"


class _BlockRecorder:
    """Stands in for ``linear_kernel``: records each launch's ``BLOCK_M``; with ``skew``,
    a wide launch (``BLOCK_M > 16``) then changes one output bit (a hardware whose wide
    MMA rounds differently)."""

    def __init__(self, kernel: object, skew: bool = False) -> None:
        self.kernel, self.skew = kernel, skew
        self.blocks: list[int] = []

    def __getitem__(self, grid: tuple[int, ...]) -> object:
        def launch(*args: object, **kwargs: object) -> None:
            self.blocks.append(int(kwargs["BLOCK_M"]))  # type: ignore[call-overload]  # a constexpr int
            self.kernel[grid](*args, **kwargs)  # type: ignore[index]  # a Triton kernel, untyped
            y = args[3]
            if self.skew and int(kwargs["BLOCK_M"]) > 16 and isinstance(y, torch.Tensor):  # type: ignore[call-overload]  # as above
                bits = y.view(torch.int16 if y.dtype.itemsize == 2 else torch.int32)
                bits.view(-1)[0] ^= 1
        return launch


@needs_interpreter
def test_wide_row_tiles_become_effective_only_after_their_self_test(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The guard: wide row tiles are used once :func:`wide_rows_hold` found them bitwise
    equal to 16-row tiles on that device and dtype; a wide MMA that differs in one bit
    keeps every call on 16-row tiles (fail closed); ``DFLASH_WIDE_ROWS=0`` turns them off
    without a self-test."""
    cpu = torch.device("cpu")
    x, w, _ = _inputs(64, 20, 48, torch.float32, seed=30)
    recorder = _BlockRecorder(linear_triton.linear_kernel)
    monkeypatch.setattr(linear_triton, "linear_kernel", recorder)
    monkeypatch.setattr(linear_triton, "_WIDE_CHECKED", {})
    assert wide_row_tiles(cpu, torch.float32)
    linear(x, w, backend="triton")
    assert recorder.blocks[-1] == 64
    recorder.blocks.clear()
    linear(x[:1], w, backend="triton")   # a decode row: 16 rows, no self-test needed
    assert recorder.blocks == [16]

    skewed = _BlockRecorder(recorder.kernel, skew=True)
    monkeypatch.setattr(linear_triton, "linear_kernel", skewed)
    assert not wide_rows_hold(cpu, torch.float32)
    monkeypatch.setattr(linear_triton, "_WIDE_CHECKED", {})
    assert not wide_row_tiles(cpu, torch.float32)
    assert not wide_row_tiles(cpu, torch.float32)   # cached: one self-test per process
    skewed.blocks.clear()
    got = linear(x, w, backend="triton")
    assert skewed.blocks == [16]
    assert torch.equal(got[5], linear(x[5:6], w, backend="triton")[0])

    def refuse(device: torch.device, dtype: torch.dtype) -> bool:
        raise AssertionError("no self-test when wide tiles are turned off")

    monkeypatch.setattr(linear_triton, "_WIDE_CHECKED", {})
    monkeypatch.setattr(linear_triton, "wide_rows_hold", refuse)
    monkeypatch.setenv("DFLASH_WIDE_ROWS", "0")
    assert not wide_row_tiles(cpu, torch.bfloat16)


# ---------------------------------------------------------------- split-K in the kernel


@needs_interpreter
@pytest.mark.parametrize(("M", "wide"), [(1, False), (17, False), (40, False), (40, True)])
def test_the_last_split_adds_the_partials_with_the_reduction_pass_bits(
    M: int, wide: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Split-K partial sums added inside the kernel by the last split to arrive: the bits
    of the separate reduction pass (split order ascending, then the bias), call after call
    (every arrival counter back at 0), at one and several row tiles and a wide tile; the
    reduction pass is not launched. float32 output, so another order shows in the bits."""
    N, K, dtype = 96, 2048, torch.float32
    gen = torch.Generator().manual_seed(11)
    w = linear_triton._hostile(N, K, dtype, gen)
    x = linear_triton._hostile(M, K, dtype, gen)
    # a bias as large as the sums (2^4 … 2^44): where it is added changes the rounding
    b = linear_triton._hostile(1, N, dtype, gen)[0] * 2.0**24
    assert linear_triton.linear_launch(M, N, K, dtype, wide=wide).split == 8
    reduction_pass = linear_triton.linear_reduce_kernel
    monkeypatch.setattr(linear_triton, "SPLIT_FIXUP", True)
    monkeypatch.setattr(linear_triton, "linear_reduce_kernel", None)   # never launched
    got = [launch_linear(x, w, b, torch.full((M, N), NAN), wide=wide) for _ in range(2)]
    assert not linear_triton._COUNTERS[torch.device("cpu")].any()
    monkeypatch.setattr(linear_triton, "linear_reduce_kernel", reduction_pass)
    monkeypatch.setattr(linear_triton, "SPLIT_FIXUP", False)
    want = launch_linear(x, w, b, torch.full((M, N), NAN), wide=wide)
    assert not want.isnan().any()
    for y in got:
        assert torch.equal(y.view(torch.int32), want.view(torch.int32))
