"""Float8 weight-only linear: the block quantizer, the reference against a float64 oracle,
Triton (interpreter) against the reference, rows independent of M on both backends,
NaN-poisoned outputs and argument checks.

Sizes are small with partial blocks (N = 200, K = 300); 32-wide blocks give several
scale blocks in both directions (7 × 10) and, with the default config, two K splits.
Block magnitudes span 2^-4 … 2^4 so a scale applied to the wrong block shows.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest
import torch
from kernels_support import NAN, needs_interpreter, rel_rms

from dflash.errors import KernelBoundsError
from dflash.kernels.checks import Backend
from dflash.kernels.fp8_linear import dequantize_fp8, fp8_linear, quantize_fp8
from dflash.kernels.fp8_linear_reference import fp8_linear_reference
from dflash.kernels.fp8_linear_triton import (
    Fp8LinearConfig,
    fp8_linear_config,
    fp8_linear_launch,
    launch_fp8_linear,
)

N, K = 200, 300
BLOCKS = [(128, 128), (32, 32), (48, 32)]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
#: relative RMS against the float64 oracle. bf16 under the interpreter: its float32 ->
#: bfloat16 store truncates (twice the round-to-nearest error), as for :func:`linear`.
TOL = {torch.float64: 1e-12, torch.float32: 1e-6, torch.bfloat16: 1e-2, torch.float16: 2e-3}
BACKENDS = ["reference", pytest.param("triton", marks=needs_interpreter)]
M_VALUES = (1, 2, 15, 16, 17, 33)


def _float_weight(n: int, k: int, block: tuple[int, int], seed: int) -> torch.Tensor:
    """``[n, k]`` float32 weights whose blocks have magnitudes 2^-4 … 2^4 apart."""
    gen = torch.Generator().manual_seed(seed)
    nb, kb = math.ceil(n / block[0]), math.ceil(k / block[1])
    mag = 2.0 ** torch.randint(-4, 5, (nb, kb), generator=gen).float()
    mag = mag.repeat_interleave(block[0], 0)[:n].repeat_interleave(block[1], 1)[:, :k]
    return torch.randn(n, k, generator=gen) / math.sqrt(k) * mag


def _inputs(
    M: int, block: tuple[int, int], dtype: torch.dtype, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, K] (rows all different), weight_fp8 [N, K], scale_inv, bias [N]."""
    gen = torch.Generator().manual_seed(seed + 1)
    q, s = quantize_fp8(_float_weight(N, K, block, seed), block)
    x = torch.randn(M, K, generator=gen).to(dtype)
    b = torch.randn(N, generator=gen).to(dtype)
    return x, q, s, b


def _oracle(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor, block: tuple[int, int],
            b: torch.Tensor | None = None) -> torch.Tensor:
    """Independent float64 oracle: dequantize every element by an explicit block loop,
    then one matmul."""
    w = q.double()
    bn, bk = block
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            w[i * bn : (i + 1) * bn, j * bk : (j + 1) * bk] *= float(s[i, j])
    y = x.double() @ w.T
    return y if b is None else y + b.double()


# ---------------------------------------------------------------- quantize / dequantize


@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_round_trip(block: tuple[int, int], dtype: torch.dtype) -> None:
    """Scales are each block's absmax / 448 (shape ``[ceil(N/bn), ceil(K/bk)]``), the
    block's largest magnitude lands on ±448, and every element comes back within e4m3
    rounding: half an ulp of 3 mantissa bits (2^-4 relative) or, below the normal range,
    half the subnormal step (2^-10 of the block's scale)."""
    w = _float_weight(N, K, block, seed=1).to(dtype)
    q, s = quantize_fp8(w, block)
    nb, kb = math.ceil(N / block[0]), math.ceil(K / block[1])
    assert q.dtype == torch.float8_e4m3fn and q.shape == (N, K)
    assert s.dtype == torch.float32 and s.shape == (nb, kb)
    bn, bk = block
    for i in range(nb):
        for j in range(kb):
            rows, cols = slice(i * bn, (i + 1) * bn), slice(j * bk, (j + 1) * bk)
            amax = w[rows, cols].float().abs().max()
            assert s[i, j] == amax / 448, f"block {(i, j)}"
            assert q[rows, cols].float().abs().max() == 448, f"block {(i, j)}"
    back = dequantize_fp8(q, s, block, torch.float64)
    per_elem = s.double().repeat_interleave(block[0], 0)[:N].repeat_interleave(block[1], 1)[:, :K]
    err = (back - w.double()).abs()
    bound = 2.0**-4 * w.double().abs() + 2.0**-10 * per_elem
    assert (err <= bound * (1 + 1e-6)).all()
    assert (err <= 2.0**-3 * per_elem * 448).all()   # the coarse bound: 2^-3 of the amax
    assert rel_rms(back, w.double()) < 2.0**-4


def test_zero_block_and_the_448_limits() -> None:
    """An all-zero block gets scale 1 and zeros; values exactly at ±amax land exactly on
    ±448 (never NaN, e4m3fn has no infinity); weights already on the e4m3 grid with
    amax 448 round-trip exactly."""
    w = torch.zeros(40, 40)
    w[:32, 32:] = torch.linspace(-1000.0, 1000.0, 32 * 8).view(32, 8)
    on_grid = torch.tensor([448.0, -448.0, 1.0, -0.5, 2.0**-9, 0.0, 240.0, -13.0])
    w[32:, :8] = on_grid.repeat(8, 1)
    q, s = quantize_fp8(w, (32, 32))
    assert s.shape == (2, 2)
    assert s[0, 0] == 1 and torch.equal(q[:32, :32].float(), torch.zeros(32, 32))
    assert s[0, 1] == torch.tensor(1000.0) / 448 and s[1, 0] == 1
    qf = q.float()
    assert not torch.isnan(qf).any()
    assert qf[0, 32] == -448 and qf[31, 39] == 448
    assert torch.equal(dequantize_fp8(q, s, (32, 32))[32:, :8], w[32:, :8])
    big = torch.full((4, 4), 3.0e38)   # amax / 448 and w / scale_inv stay finite
    qb, sb = quantize_fp8(big, (4, 4))
    assert torch.equal(qb.float(), torch.full((4, 4), 448.0)) and torch.isfinite(sb).all()


def test_dequantize_dtypes_and_partial_blocks() -> None:
    q, s = quantize_fp8(_float_weight(N, K, (128, 128), seed=2))
    want = q.double() * s.double().repeat_interleave(128, 0)[:N].repeat_interleave(128, 1)[:, :K]
    assert torch.equal(dequantize_fp8(q, s, dtype=torch.float64), want)
    for dtype in DTYPES:
        got = dequantize_fp8(q, s, (128, 128), dtype)
        assert got.dtype == dtype and torch.equal(got, want.float().to(dtype))


# ---------------------------------------------------------------- the linear


@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("dtype", [torch.float64, *DTYPES])
def test_reference_matches_float64_oracle(block: tuple[int, int], dtype: torch.dtype) -> None:
    x, q, s, b = _inputs(5, block, dtype, seed=3)
    out = torch.full((5, N), NAN, dtype=dtype)
    got = fp8_linear_reference(x, q, s, b, block=block, out=out)
    assert got is out and torch.isfinite(got).all()
    assert rel_rms(got, _oracle(x, q, s, block, b)) <= TOL[dtype]
    no_bias = fp8_linear_reference(x, q, s, block=block)
    assert rel_rms(no_bias, _oracle(x, q, s, block)) <= TOL[dtype]


@needs_interpreter
@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_matches_reference(block: tuple[int, int], dtype: torch.dtype) -> None:
    """Both backends scale each K block's float32 partial sum, in the same order: they
    agree to float32 rounding (float32 x), or the output rounding (16-bit x)."""
    x, q, s, b = _inputs(17, block, dtype, seed=4)
    out = torch.full((17, N), NAN, dtype=dtype)
    got = fp8_linear(x, q, s, b, block=block, out=out, backend="triton")
    assert got is out and torch.isfinite(got).all()
    ref = fp8_linear(x, q, s, b, block=block, backend="reference")
    assert rel_rms(got, ref) <= TOL[dtype]
    assert rel_rms(got, _oracle(x, q, s, block, b)) <= TOL[dtype]
    no_bias = fp8_linear(x, q, s, block=block, backend="triton")
    assert rel_rms(no_bias, _oracle(x, q, s, block)) <= TOL[dtype]


Call = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _check_rows_do_not_depend_on_M(fn: Call, x: torch.Tensor) -> None:
    """Row i of an M-row call ``fn(rows, out)`` is bitwise the 1-row call on its source
    row, for every M in :data:`M_VALUES`, the rows in a different order (so other
    positions, other neighbours) for each M; outputs NaN-poisoned."""
    R = x.shape[0]
    alone = [fn(x[i : i + 1], torch.full((1, N), NAN, dtype=x.dtype))[0] for i in range(R)]
    for M in M_VALUES:
        order = [(7 * i + 5 * M) % R for i in range(M)]
        got = fn(x[order], torch.full((M, N), NAN, dtype=x.dtype))
        for i, src in enumerate(order):
            assert torch.equal(got[i], alone[src]), f"M={M} row {i} (source row {src})"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("dtype", "block"),
                         [(torch.bfloat16, (32, 32)), (torch.float32, (128, 128))])
def test_rows_do_not_depend_on_M(backend: Backend, dtype: torch.dtype,
                                 block: tuple[int, int]) -> None:
    """(bf16, 32 × 32): 10 K blocks in 2 splits of 5; (f32, 128 × 128): one split of 3
    blocks. M = 33 runs 4 row tiles per program."""
    x, q, s, b = _inputs(33, block, dtype, seed=5)
    _check_rows_do_not_depend_on_M(
        lambda xs, out: fp8_linear(xs, q, s, b, block=block, out=out, backend=backend), x)


@needs_interpreter
def test_uneven_split_rows_do_not_depend_on_M() -> None:
    """3 splits over 10 K blocks (4, 4, 2: the last split's loop runs past the last block,
    every load masked): rows still fixed, the sum still right."""
    cfg = Fp8LinearConfig(block_n=64, block_k=32, split_k=3, num_warps=4, num_stages=1)
    assert fp8_linear_launch(33, N, K, torch.float16, (32, 32), cfg).split == 3
    x, q, s, b = _inputs(33, (32, 32), torch.float16, seed=6)
    _check_rows_do_not_depend_on_M(
        lambda xs, out: launch_fp8_linear(xs, q, s, b, (32, 32), out, cfg), x)
    got = launch_fp8_linear(x, q, s, b, (32, 32), None, cfg)
    assert rel_rms(got, _oracle(x, q, s, (32, 32), b)) <= TOL[torch.float16]


@pytest.mark.parametrize("backend", BACKENDS)
def test_rank3_and_strided_out(backend: Backend) -> None:
    """x [2, 3, K] and out a column slice of a wider buffer: every element written, the
    rest of the buffer untouched."""
    x, q, s, b = _inputs(6, (32, 32), torch.float32, seed=7)
    buf = torch.full((2, 3, N + 20), NAN)
    out = buf[..., 5 : 5 + N]
    got = fp8_linear(x.view(2, 3, K), q, s, b, block=(32, 32), out=out, backend=backend)
    assert got is out and got.shape == (2, 3, N) and torch.isfinite(out).all()
    assert torch.isnan(buf[..., :5]).all() and torch.isnan(buf[..., 5 + N :]).all()
    assert rel_rms(out.reshape(6, N), _oracle(x, q, s, (32, 32), b)) <= 1e-6
    alloc = fp8_linear(x.view(2, 3, K), q, s, b, block=(32, 32), backend=backend)
    assert alloc.shape == (2, 3, N) and torch.equal(alloc, out)


@pytest.mark.parametrize("backend", BACKENDS)
def test_zero_rows(backend: Backend) -> None:
    x, q, s, _ = _inputs(0, (128, 128), torch.float32, seed=8)
    assert fp8_linear(x, q, s, backend=backend).shape == (0, N)


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_whole_tiles_load_without_masks_and_give_the_masked_bits(
    dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A shape of whole N tiles and whole scale blocks whose splits end at the last block
    launches without masks but the rows' (``even``): the masked loads give its bits
    exactly; a shape that is not whole keeps its masks."""
    from dflash.kernels import fp8_linear_triton as ft
    n, k, block = 128, 256, (32, 32)
    q, s = quantize_fp8(_float_weight(n, k, block, seed=7), block)
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(17, k, generator=gen).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype)
    assert ft.fp8_linear_launch(17, n, k, dtype, block).even
    assert not ft.fp8_linear_launch(17, N, K, dtype, block).even
    got = launch_fp8_linear(x, q, s, b, block, None)
    real = ft.fp8_linear_launch
    monkeypatch.setattr(ft, "fp8_linear_launch",
                        lambda *a, **kw: replace(real(*a, **kw), even=False))
    assert torch.equal(got, launch_fp8_linear(x, q, s, b, block, None))
    assert rel_rms(got, _oracle(x, q, s, block, b)) <= TOL[dtype]


def test_config_is_a_function_of_the_shape() -> None:
    """Tiles and splits depend on (N, K, block) only; M moves the pipeline depth alone.
    The 9B shapes: 128-row N tiles; split 8 for 4096 × 4096, 16 for 4096 × 12288, 4 for
    12288 × 4096 (the H200 sweep's best at the two it timed), 1 for the LM head."""
    assert fp8_linear_config(N, K, torch.bfloat16, (32, 32)).split_k == 2
    assert fp8_linear_config(N, K, torch.bfloat16, (128, 128)).split_k == 1
    assert fp8_linear_config(N, K, torch.bfloat16, (48, 48)).block_k == 64
    assert fp8_linear_config(96, 4096, torch.bfloat16).block_n == 128   # N < 128: padded
    assert fp8_linear_config(40, 4096, torch.bfloat16).block_n == 64
    for n, k, split in ((4096, 4096, 8), (4096, 12288, 16), (12288, 4096, 4),
                        (248320, 4096, 1)):
        cfgs = [fp8_linear_config(n, k, torch.bfloat16, (128, 128), t) for t in (1, 2, 4, 8)]
        assert [c.num_stages for c in cfgs] == [4, 4, 3, 2]
        assert {(c.block_n, c.block_k, c.split_k) for c in cfgs} == {(128, 128, split)}
    assert fp8_linear_launch(64, 4096, 12288, torch.bfloat16).grid == (1, 32, 16)
    assert fp8_linear_launch(129, 12288, 4096, torch.bfloat16).grid == (2, 96, 4)
    with pytest.raises(ValueError, match="'block' must be"):
        fp8_linear_config(64, 64, torch.bfloat16, (128, 40))
    with pytest.raises(ValueError, match="'config' block_k"):
        cfg = fp8_linear_config(64, 64, torch.bfloat16)   # block_k 128, not 32
        fp8_linear_launch(1, 64, 64, torch.bfloat16, (32, 32), cfg)


# ---------------------------------------------------------------- the x-major form


def e4m3_bits_to_bf16(raw: torch.Tensor) -> torch.Tensor:
    """What :data:`~dflash.kernels.fp8_linear_triton.E4M3_TO_BF16` computes, in torch: each
    byte ``s eeee mmm`` (uint8) moved to the high byte of a 16-bit lane, ``eeee mmm``
    shifted right by 4 and masked under the sign: the bfloat16 pattern ``s 0000 eeee mmm
    0000`` (the byte's value times 2^-120), then multiplied by 2^120 in float32 and rounded
    to bfloat16 (the PTX multiplies in bf16x2: the product is exact either way)."""
    lane = raw.to(torch.int32) << 8
    bits = ((lane >> 4) & 0x07F0) | (lane & 0x8000)
    small = bits.to(torch.int16).view(torch.bfloat16)
    return (small.float() * 2.0**120).to(torch.bfloat16)


def test_the_bit_conversion_gives_every_finite_bytes_value() -> None:
    """The integer widening and the 2^120 product give torch's own e4m3 value for each of
    the 254 finite bytes (signed zeros and the 14 subnormals included), bit for bit; the
    two NaN bytes would give ±480, which is why a checkpoint holding them is refused."""
    raw = torch.arange(256, dtype=torch.uint8)
    want = raw.view(torch.float8_e4m3fn).to(torch.bfloat16)
    got = e4m3_bits_to_bf16(raw)
    finite = (raw & 0x7F) != 0x7F
    assert int(finite.sum()) == 254
    assert torch.equal(got[finite].view(torch.int16), want[finite].view(torch.int16))
    assert got[0x7F] == 480 and got[0xFF] == -480
    assert torch.signbit(got[0x80]) and not torch.signbit(got[0])


def test_the_form_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """``DFLASH_FP8_FORM``: unset or empty (the default: both on), ``none``, ``x_major``,
    ``bits`` or both; anything else is refused by name."""
    from dflash.kernels.fp8_linear_triton import form_from_env
    monkeypatch.delenv("DFLASH_FP8_FORM", raising=False)
    assert form_from_env() == (True, True)
    for raw, want in (("", (True, True)), ("none", (False, False)),
                      ("x_major", (True, False)), ("bits", (False, True)),
                      ("x_major,bits", (True, True)), ("bits,x_major", (True, True))):
        monkeypatch.setenv("DFLASH_FP8_FORM", raw)
        assert form_from_env() == want
    for raw in ("words", "x_major,x_major", "x-major", "bits, x_major", "None", "none,bits"):
        monkeypatch.setenv("DFLASH_FP8_FORM", raw)
        with pytest.raises(ValueError, match=f"DFLASH_FP8_FORM must be .* \\(got {raw!r}\\)"):
            form_from_env()


@needs_interpreter
@pytest.mark.parametrize("bit_convert", [False, True])
@pytest.mark.parametrize(("dtype", "block"), [(torch.bfloat16, (32, 32)),
                                               (torch.float32, (128, 128)),
                                               (torch.float16, (48, 32))])
def test_the_x_major_form_keeps_rows_independent_of_M(
    dtype: torch.dtype, block: tuple[int, int], bit_convert: bool
) -> None:
    """``x_major`` (``x_tile @ w_tile.T``): rows bitwise independent of M for M = 1 … 33
    (up to 4 row tiles a program, with split-K at 32 × 32), and close to the float64
    oracle; every finite e4m3 byte in the weight; outputs NaN-poisoned. (``bit_convert``
    is the PTX conversion on a GPU; the interpreter converts with ``.to``, so here it
    checks that the option launches the same arithmetic.)"""
    x, q, s, b = _inputs(33, block, dtype, seed=9)
    q = q.clone()
    every = torch.arange(256, dtype=torch.uint8)
    q.view(torch.uint8)[:2, :128] = torch.where((every & 0x7F) == 0x7F, every - 1,
                                                every).view(2, 128)
    base = fp8_linear_config(N, K, dtype, block, 4)
    cfg = Fp8LinearConfig(base.block_n, base.block_k, base.split_k, base.num_warps,
                          base.num_stages, x_major=True, bit_convert=bit_convert)
    _check_rows_do_not_depend_on_M(
        lambda xs, out: launch_fp8_linear(xs, q, s, b, block, out, cfg), x)
    got = launch_fp8_linear(x, q, s, b, block, torch.full((33, N), NAN, dtype=dtype), cfg)
    assert rel_rms(got, _oracle(x, q, s, block, b)) <= TOL[dtype]


# ---------------------------------------------------------------- argument checks

_Q = torch.zeros(4, 3, dtype=torch.float8_e4m3fn)
_S = torch.ones(1, 1)
#: wrongly typed arguments, on purpose (typed Any so the calls type-check)
_BAD_TENSOR: Any = [[1.0]]
_BAD_DTYPE: Any = "float32"
_BAD_BLOCK: Any = (128,)


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        ({"x": [1.0]}, TypeError, "'x' must be a torch.Tensor"),
        ({"x": torch.ones(2, 3, dtype=torch.int32)}, KernelBoundsError, "'x' must be a floating"),
        ({"x": torch.ones(2, 0)}, KernelBoundsError, "'x' last dimension K"),
        ({"weight": "w"}, TypeError, "'weight' must be a torch.Tensor"),
        ({"weight": torch.ones(4, 3)}, KernelBoundsError,
         r"'weight' must be a 2-dimensional torch.float8_e4m3fn tensor \(got dtype torch.float32"),
        ({"weight": _Q[0]}, KernelBoundsError, "'weight' must be a 2-dimensional"),
        ({"weight": _Q[:0]}, KernelBoundsError, r"'weight' must have N >= 1 rows .* \(0, 3\)"),
        ({"weight": torch.zeros(4, 5, dtype=torch.float8_e4m3fn)}, KernelBoundsError,
         r"'weight' must have shape \[N, K\] with K from x = \(4, 3\) \(got \(4, 5\)\)"),
        ({"weight": torch.zeros(3, 4, dtype=torch.float8_e4m3fn).T}, KernelBoundsError,
         r"'weight' must be contiguous along K \(got strides \(1, 4\)\)"),
        ({"scale_inv": None}, TypeError, "'scale_inv' must be a torch.Tensor"),
        ({"scale_inv": torch.ones(1, 1, dtype=torch.float64)}, KernelBoundsError,
         "'scale_inv' must be a 2-dimensional torch.float32"),
        ({"scale_inv": torch.ones(2, 1)}, KernelBoundsError,
         r"'scale_inv' must have shape .* = \(1, 1\) \(got \(2, 1\)\)"),
        ({"block": (2, 2)}, KernelBoundsError,
         r"'scale_inv' must have shape .*block=\(2, 2\) = \(2, 2\) \(got \(1, 1\)\)"),
        ({"block": 128}, TypeError, r"'block' must be a pair of ints \(bn, bk\) \(got 128\)"),
        ({"block": (128, 128, 1)}, TypeError, "'block' must be a pair of ints"),
        ({"block": (128.0, 128)}, TypeError, "'block' must be a pair of ints"),
        ({"block": (True, 128)}, TypeError, "'block' must be a pair of ints"),
        ({"block": (0, 128)}, KernelBoundsError, r"'block' sizes must be >= 1 \(got \(0, 128\)\)"),
        ({"bias": torch.ones(5)}, KernelBoundsError, "'bias' must have shape"),
        ({"bias": torch.ones(4, dtype=torch.float16)}, KernelBoundsError, "'bias' must be"),
        ({"out": torch.ones(2, 5)}, KernelBoundsError, "'out' must have shape"),
        ({"out": torch.ones(2, 4, dtype=torch.float16)}, KernelBoundsError, "'out' must be"),
        ({"out": torch.ones(4, 2).T}, KernelBoundsError, "'out' must have a contiguous last"),
        ({"scale_inv": torch.ones(1, 1, device="meta")}, KernelBoundsError,
         "'scale_inv' is on meta"),
        ({"bias": torch.ones(4, device="meta")}, KernelBoundsError, "'bias' is on meta"),
        ({"backend": "cuda"}, KernelBoundsError, "'backend' must be"),
    ],
)
def test_bad_arguments_are_named(kwargs: dict[str, object], exc: type, match: str) -> None:
    args: dict[str, object] = {"x": torch.ones(2, 3), "weight": _Q, "scale_inv": _S,
                               "bias": None, "block": (128, 128), "out": None,
                               "backend": "reference"}
    args.update(kwargs)
    with pytest.raises(exc, match=match):
        fp8_linear(args["x"], args["weight"], args["scale_inv"], args["bias"],  # type: ignore[arg-type]  # bad values on purpose
                   block=args["block"], out=args["out"], backend=args["backend"])  # type: ignore[arg-type]  # as above


@needs_interpreter
def test_triton_rejects_float64_and_unsupported_blocks() -> None:
    x, q, s, _ = _inputs(2, (32, 32), torch.float64, seed=9)
    with pytest.raises(KernelBoundsError, match="'x' dtype must be float16, bfloat16 or float32"):
        fp8_linear(x, q, s, block=(32, 32), backend="triton")
    q2, s2 = quantize_fp8(torch.ones(8, 40), (8, 40))
    x2 = torch.ones(1, 40)
    with pytest.raises(KernelBoundsError, match=r"'block' bk must be a multiple of 16 .*\(8, 40\)"):
        fp8_linear(x2, q2, s2, block=(8, 40), backend="triton")
    assert torch.equal(fp8_linear(x2, q2, s2, block=(8, 40), backend="reference"),
                       torch.full((1, 8), 40.0))


@pytest.mark.parametrize(
    ("call", "exc", "match"),
    [
        (lambda: quantize_fp8(_BAD_TENSOR), TypeError, "'weight' must be a torch.Tensor"),
        (lambda: quantize_fp8(torch.ones(3)), KernelBoundsError, "'weight' must have 2 dimensions"),
        (lambda: quantize_fp8(torch.ones(0, 3)), KernelBoundsError, "'weight' must have N >= 1"),
        (lambda: quantize_fp8(torch.tensor([[1.0, float("inf")]])), KernelBoundsError,
         "'weight' must be finite"),
        (lambda: quantize_fp8(torch.ones(2, 2), (2, -1)), KernelBoundsError, "'block' sizes"),
        (lambda: dequantize_fp8(torch.ones(4, 3), _S), KernelBoundsError,
         "'weight_fp8' must be a 2-dimensional torch.float8_e4m3fn"),
        (lambda: dequantize_fp8(_Q, torch.ones(2, 2)), KernelBoundsError,
         "'scale_inv' must have shape"),
        (lambda: dequantize_fp8(_Q, _S, dtype=torch.int8), KernelBoundsError,
         "'dtype' must be float16"),
        (lambda: dequantize_fp8(_Q, _S, dtype=_BAD_DTYPE), TypeError,
         "'dtype' must be a torch.dtype"),
        (lambda: dequantize_fp8(_Q, _S, _BAD_BLOCK), TypeError, "'block' must be a pair"),
    ],
)
def test_quantizer_bad_arguments_are_named(
    call: Callable[[], object], exc: type, match: str
) -> None:
    with pytest.raises(exc, match=match):
        call()


@needs_interpreter
@pytest.mark.parametrize("M", [1, 17, 40])
def test_the_last_split_adds_the_partials_with_the_reduction_pass_bits(
    M: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Up to two row tiles the last split to arrive adds the split-K partial sums inside
    the kernel (the reduction pass is not launched), call after call; from four tiles the
    reduction pass does. Either way the bits are the reduction pass's (float32 output, so
    another order would show)."""
    from dflash.kernels import fp8_linear_triton as ft
    from dflash.kernels import linear_triton as lt
    n, k, block = 64, 512, (32, 32)
    q, s = quantize_fp8(_float_weight(n, k, block, seed=9), block)
    gen = torch.Generator().manual_seed(10)
    x = torch.randn(M, k, generator=gen) * 2.0 ** torch.randint(-12, 13, (M, k), generator=gen)
    b = torch.randn(n, generator=gen) * 64
    plan = ft.fp8_linear_launch(M, n, k, torch.float32, block)
    assert plan.split == 4 and plan.m_tiles == (1 if M == 1 else 2 if M == 17 else 4)
    monkeypatch.setattr(lt, "SPLIT_FIXUP", True)
    if plan.m_tiles <= 2:
        monkeypatch.setattr(ft, "linear_reduce_kernel", None)   # never launched
    got = [launch_fp8_linear(x, q, s, b, block, torch.full((M, n), NAN)) for _ in range(2)]
    assert not lt._COUNTERS[torch.device("cpu")].any()
    monkeypatch.undo()
    monkeypatch.setattr(lt, "SPLIT_FIXUP", False)
    want = launch_fp8_linear(x, q, s, b, block, torch.full((M, n), NAN))
    assert not want.isnan().any()
    for y in got:
        assert torch.equal(y.view(torch.int32), want.view(torch.int32))
