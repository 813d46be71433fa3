"""Float8 weight-only linear at the Qwen3.5-9B projection shapes on a GPU (skipped without
CUDA): close to a float64 oracle on the dequantized weight, and rows bitwise independent
of the row count. No timing.

Run: ``python -m pytest tests/gpu/test_fp8_linear_gpu.py -q``
"""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from dflash.kernels.fp8_linear import dequantize_fp8, fp8_linear, quantize_fp8
from dflash.kernels.fp8_linear_triton import e4m3_values

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
NAN = float("nan")
#: (N, K): the 9B's square, up (gate/up) and down shapes, and the transposed-square one
SHAPES = [(4096, 4096), (12288, 4096), (4096, 12288), (12288, 12288)]
ROWS = (1, 16, 64)
TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 1e-5}


def rel_rms(got: torch.Tensor, ref: torch.Tensor) -> float:
    g, r = got.double(), ref.double()
    if not torch.isfinite(g).all():
        return float("inf")
    return float((g - r).norm() / r.norm())


def _inputs(N: int, K: int, dtype: torch.dtype, seed: int, rows: int = 64,
            ) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(rows, K, generator=gen, device="cuda").to(dtype)
    w = torch.randn(N, K, generator=gen, device="cuda") / K**0.5
    q, s = quantize_fp8(w)
    return x, q, s


@pytest.mark.parametrize(("N", "K"), SHAPES)
def test_fp8_linear_matches_the_oracle(N: int, K: int) -> None:
    x, q, s = _inputs(N, K, torch.bfloat16, seed=N + K)
    oracle = x.double() @ dequantize_fp8(q, s, dtype=torch.float64).T
    for M in ROWS:
        out = torch.full((M, N), NAN, dtype=torch.bfloat16, device="cuda")
        got = fp8_linear(x[:M], q, s, out=out)
        assert got is out
        assert rel_rms(got, oracle[:M]) <= TOL[torch.bfloat16], f"M={M}"
        ref = fp8_linear(x[:M], q, s, backend="reference")
        assert rel_rms(got, ref) <= TOL[torch.bfloat16], f"M={M}"


@pytest.mark.parametrize(("N", "K"), SHAPES)
def test_fp8_linear_rows_do_not_depend_on_M(N: int, K: int) -> None:
    """Rows of 1- and 16-row calls, taken at the front, an odd offset and the back of 64
    rows, bitwise equal the same rows of the 64-row call (1, 1 and 4 row tiles per
    program); a 200-row call (two row groups) holds the same 64 rows too."""
    x, q, s = _inputs(N, K, torch.bfloat16, seed=N + 2 * K, rows=200)
    full = fp8_linear(x[:64], q, s, out=torch.full((64, N), NAN, dtype=torch.bfloat16,
                                                   device="cuda"))
    assert torch.equal(fp8_linear(x, q, s)[:64], full)
    for M in ROWS:
        for first in sorted({f for f in (0, 7, 64 - M) if f + M <= 64}):
            got = fp8_linear(x[first : first + M], q, s)
            assert torch.equal(got, full[first : first + M]), f"M={M} rows {first}.."


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_fp8_linear_other_dtypes(dtype: torch.dtype) -> None:
    N, K = 4096, 12288
    x, q, s = _inputs(N, K, dtype, seed=3)
    b = torch.randn(N, device="cuda").to(dtype)
    oracle = x.double() @ dequantize_fp8(q, s, dtype=torch.float64).T + b.double()
    full = fp8_linear(x, q, s, b)
    assert rel_rms(full, oracle) <= TOL[dtype]
    for M in ROWS:
        assert torch.equal(fp8_linear(x[:M], q, s, b), full[:M]), f"M={M}"


@triton.jit  # type: ignore[untyped-decorator]  # triton ships no types
def convert(src, dst, BITS: tl.constexpr):  # type: ignore[no-untyped-def]  # untyped
    """256 e4m3 bytes to bfloat16 by :func:`e4m3_values`."""
    o = tl.arange(0, 256)
    tl.store(dst + o, e4m3_values(tl.load(src + o), tl.bfloat16, BITS))


def test_the_bit_conversion_ptx_gives_every_finite_bytes_value() -> None:
    """``E4M3_TO_BF16`` (compiled PTX) on all 256 bytes: each finite byte's bfloat16 value
    bit for bit, as ``.to`` converts it; the NaN bytes give ±480 (refused at load)."""
    raw = torch.arange(256, dtype=torch.uint8, device="cuda")
    by_bits = torch.full((256,), NAN, dtype=torch.bfloat16, device="cuda")
    by_to = torch.full((256,), NAN, dtype=torch.bfloat16, device="cuda")
    convert[(1,)](raw.view(torch.float8_e4m3fn), by_bits, BITS=True)
    convert[(1,)](raw.view(torch.float8_e4m3fn), by_to, BITS=False)
    finite = (raw & 0x7F) != 0x7F
    assert torch.equal(by_bits[finite].view(torch.int16), by_to[finite].view(torch.int16))
    assert by_bits[0x7F] == 480 and by_bits[0xFF] == -480


@pytest.mark.parametrize(("N", "K"), [(4096, 4096), (12288, 4096), (4096, 12288)])
def test_the_x_major_forms(N: int, K: int) -> None:
    """``x_major`` (``x_tile @ w_tile.T``) with ``.to`` and with the bit conversion: bitwise
    equal to each other (the same products of the same values), rows of 1-, 16- and
    64-row calls bitwise equal to the 64-row call's (and a 200-row call's), close to the
    float64 oracle; every finite e4m3 byte in the weight; outputs NaN-poisoned."""
    from dataclasses import replace

    from dflash.kernels.fp8_linear_triton import fp8_linear_config, launch_fp8_linear

    x, q, s = _inputs(N, K, torch.bfloat16, seed=N + 3 * K, rows=200)
    every = torch.arange(256, dtype=torch.uint8, device="cuda")
    q.view(torch.uint8)[:2, :128] = torch.where((every & 0x7F) == 0x7F, every - 1,
                                                every).view(2, 128)
    oracle = x.double() @ dequantize_fp8(q, s, dtype=torch.float64).T
    base = fp8_linear_config(N, K, torch.bfloat16)

    def run(rows: torch.Tensor, bits: bool) -> torch.Tensor:
        cfg = replace(base, x_major=True, bit_convert=bits)
        out = torch.full((rows.shape[0], N), NAN, dtype=torch.bfloat16, device="cuda")
        return launch_fp8_linear(rows, q, s, None, (128, 128), out, cfg)

    full = run(x[:64], True)
    assert torch.equal(run(x[:64], False), full)
    assert torch.equal(run(x, True)[:64], full)
    assert rel_rms(full, oracle[:64]) <= TOL[torch.bfloat16]
    for M in ROWS:
        for first in sorted({f for f in (0, 7, 64 - M) if f + M <= 64}):
            got = run(x[first : first + M], True)
            assert torch.equal(got, full[first : first + M]), f"M={M} rows {first}.."


@pytest.mark.parametrize(("N", "K"), [(4096, 4096), (4096, 12288), (12288, 4096)])
def test_the_split_k_reduced_in_the_kernel_is_the_reduction_pass(
    N: int, K: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Up to two row tiles the last split to finish adds the partials inside the kernel:
    bitwise the reduction pass's result over 50 back-to-back launches, at 1 and 32 rows;
    every arrival counter is back at 0 after them."""
    from dflash.kernels import linear_triton as lt
    x, q, s = _inputs(N, K, torch.bfloat16, seed=N + K)
    for rows in (1, 32):
        monkeypatch.setattr(lt, "SPLIT_FIXUP", False)
        want = fp8_linear(x[:rows], q, s)
        monkeypatch.setattr(lt, "SPLIT_FIXUP", True)
        outs = [fp8_linear(x[:rows], q, s) for _ in range(50)]
        torch.cuda.synchronize()
        for got in outs:
            assert torch.equal(got, want)
    assert not lt._COUNTERS[x.device].any()
