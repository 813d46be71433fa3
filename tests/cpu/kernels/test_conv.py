"""causal_conv1d_capture: the Triton kernel (interpreter) against the float64 reference."""

from __future__ import annotations

import pytest
import torch
from kernels_support import NAN, needs_interpreter, rel_rms

from dflash.errors import KernelBoundsError
from dflash.kernels import causal_conv1d_capture, causal_conv1d_capture_reference
from dflash.kernels.checks import Backend


def conv_inputs(B: int, T: int, C: int, Kc: int, dtype: torch.dtype, bias: bool,
                seed: int) -> dict[str, torch.Tensor | None]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "x": torch.randn(B, T, C, generator=gen).to(dtype),
        "conv_rows": torch.randn(B, Kc - 1, C, generator=gen).to(dtype),
        "weight": torch.randn(C, Kc, generator=gen).to(dtype),
        "bias": torch.randn(C, generator=gen).to(dtype) if bias else None,
    }


def run(i: dict[str, torch.Tensor | None], captured: torch.Tensor, **kw: object) -> torch.Tensor:
    """causal_conv1d_capture into a NaN-poisoned ``out`` (unless the caller passes ``out``)."""
    x = i["x"]
    out = kw.pop("out", torch.full_like(x, NAN) if isinstance(x, torch.Tensor) else None)
    y = causal_conv1d_capture(x, i["conv_rows"], i["weight"], i["bias"], captured,  # type: ignore[arg-type]
                              out=out, **kw)  # type: ignore[arg-type]
    assert y is out, "the result must be the out= tensor"
    return y


# (B, T, C, Kc, bias, activation, dtype)
CASES = [
    (1, 1, 16, 4, True, "silu", torch.float32),
    (2, 3, 48, 4, False, None, torch.float32),
    (1, 16, 200, 3, True, "silu", torch.bfloat16),  # two channel blocks, the second partial
    (1, 5, 32, 2, True, "silu", torch.float32),
]


@needs_interpreter
@pytest.mark.parametrize(("B", "T", "C", "Kc", "bias", "act", "dtype"), CASES)
def test_triton_matches_float64_reference(
    B: int, T: int, C: int, Kc: int, bias: bool, act: str | None, dtype: torch.dtype
) -> None:
    i = conv_inputs(B, T, C, Kc, dtype, bias, seed=T + C)
    S = T + 2
    captured = torch.full((B, Kc - 1 + S, C), NAN, dtype=dtype)
    y = run(i, captured, activation=act, backend="triton")

    i64 = {n: (None if t is None else t.double()) for n, t in i.items()}
    cap64 = torch.full((B, Kc - 1 + S, C), NAN, dtype=torch.float64)
    y_ref = causal_conv1d_capture_reference(i64["x"], i64["conv_rows"], i64["weight"],  # type: ignore[arg-type]
                                            i64["bias"], cap64, activation=act,
                                            out=torch.full((B, T, C), NAN, dtype=torch.float64))
    assert torch.equal(cap64[:, : Kc - 1 + T].to(dtype), captured[:, : Kc - 1 + T])
    assert y.dtype == dtype
    assert rel_rms(y, y_ref) <= (1e-6 if dtype == torch.float32 else 1e-2)
    xin = torch.cat([i["conv_rows"], i["x"]], dim=1)  # type: ignore[list-item]
    assert torch.equal(captured[:, : Kc - 1 + T], xin), "the capture is an exact copy"
    assert torch.isnan(captured[:, Kc - 1 + T :].float()).all(), "rows past T untouched"


@needs_interpreter
@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_verify_equals_token_by_token_decode(backend: Backend) -> None:
    """The window after n tokens, captured[:, n:n+Kc-1], continues the conv exactly."""
    B, T, C, Kc = 1, 4, 24, 4
    i = conv_inputs(B, T, C, Kc, torch.float32, True, seed=9)
    captured = torch.full((B, Kc - 1 + T, C), NAN)
    y = run(i, captured, backend=backend)
    rows = i["conv_rows"].clone()  # type: ignore[union-attr]
    for t in range(T):
        step_cap = torch.full((B, Kc, C), NAN)
        y_t = run({**i, "x": i["x"][:, t : t + 1], "conv_rows": rows},  # type: ignore[index]
                  step_cap, backend=backend)
        assert torch.equal(y_t[:, 0], y[:, t])
        rows = step_cap[:, 1:].clone()
        assert torch.equal(rows, captured[:, t + 1 : t + Kc]), f"window after {t + 1} tokens"


@needs_interpreter
@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_remap_in_place_equals_out_of_place(backend: Backend) -> None:
    B, T, C, Kc, S = 2, 3, 40, 4, 4
    first = conv_inputs(B, T, C, Kc, torch.float32, True, seed=1)
    bank = torch.full((B, Kc - 1 + S, C), NAN)
    run(first, bank, backend=backend)
    n = 2
    second = conv_inputs(B, T, C, Kc, torch.float32, True, seed=2)
    bank_copy = bank.clone()
    y_out = run({**second, "conv_rows": bank[:, n : n + Kc - 1].clone()}, bank_copy,
                backend=backend)
    y_in = run({**second, "conv_rows": bank[:, n : n + Kc - 1]}, bank, backend=backend)
    assert torch.equal(y_in, y_out)
    assert torch.equal(bank[:, : Kc - 1 + T], bank_copy[:, : Kc - 1 + T])


@needs_interpreter
def test_strided_conv_rows() -> None:
    B, T, C, Kc = 1, 3, 16, 4
    i = conv_inputs(B, T, C, Kc, torch.float32, False, seed=4)
    strided = i["conv_rows"].transpose(1, 2).contiguous().transpose(1, 2)  # type: ignore[union-attr]
    assert not strided.is_contiguous()
    a = torch.full((B, Kc - 1 + T, C), NAN)
    b = torch.full((B, Kc - 1 + T, C), NAN)
    y_strided = run({**i, "conv_rows": strided}, a, backend="triton")
    y_plain = run(i, b, backend="reference")
    assert rel_rms(y_strided, y_plain) <= 1e-6
    assert torch.equal(a, b)


@needs_interpreter
@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_out_none_allocates_the_same_result(backend: Backend) -> None:
    i = conv_inputs(1, 5, 24, 4, torch.bfloat16, True, seed=6)
    cap_a = torch.full((1, 8, 24), NAN, dtype=torch.bfloat16)
    cap_b = torch.full((1, 8, 24), NAN, dtype=torch.bfloat16)
    into = run(i, cap_a, backend=backend)
    fresh = causal_conv1d_capture(i["x"], i["conv_rows"], i["weight"], i["bias"], cap_b,  # type: ignore[arg-type]
                                  backend=backend)
    assert fresh.dtype == torch.bfloat16 and fresh.shape == (1, 5, 24)
    assert not into.isnan().any() and torch.equal(fresh, into)
    assert torch.equal(cap_a, cap_b)


def test_bad_arguments_are_named() -> None:
    i = conv_inputs(1, 3, 16, 4, torch.float32, True, seed=0)
    cap = torch.full((1, 6, 16), NAN)
    rows, weight, bias = i["conv_rows"], i["weight"], i["bias"]
    assert rows is not None and weight is not None and bias is not None
    cases: list[tuple[dict[str, object], torch.Tensor, object, type[Exception], str]] = [
        ({"x": "x"}, cap, "silu", TypeError, "'x' must be a torch.Tensor"),
        ({"conv_rows": rows[:, :2]}, cap, "silu", ValueError, "'conv_rows' must have"),
        ({"conv_rows": rows.half()}, cap, "silu", ValueError,
         "'conv_rows' must be torch.float32"),
        ({"weight": weight[:, :1]}, cap, "silu", ValueError, "Kc must be >= 2"),
        ({"bias": bias[:3]}, cap, "silu", ValueError, "'bias' must have shape"),
        ({}, cap[:, :5], "silu", ValueError, "needs Kc-1\\+T=6 rows"),
        ({}, cap.double(), "silu", ValueError, "'captured' must be torch.float32"),
        ({}, cap.transpose(1, 2).contiguous().transpose(1, 2), "silu", ValueError,
         "contiguous along channels"),
        ({}, cap, "gelu", ValueError, "'activation'"),
        ({}, cap.to("meta"), "silu", ValueError, "'captured' is on meta"),
    ]
    for change, captured, act, error, match in cases:
        with pytest.raises(error, match=match):
            run({**i, **change}, captured, activation=act)  # type: ignore[dict-item]  # bad values on purpose
    x = i["x"]
    assert x is not None
    bad_out: list[tuple[object, type[Exception], str]] = [
        (x.tolist(), TypeError, "'out' must be a torch.Tensor or None"),
        (torch.empty(1, 2, 16), KernelBoundsError, "'out' must have shape x.shape"),
        (torch.empty(1, 3, 16, dtype=torch.float64), KernelBoundsError,
         "'out' must be torch.float32 like the result"),
        (torch.empty(1, 16, 3).transpose(1, 2), KernelBoundsError, "'out' must be contiguous"),
        (torch.empty(1, 3, 16, device="meta"), KernelBoundsError, "'out' is on meta"),
        (x, KernelBoundsError, "'out' must not share memory with 'x'"),
        (cap[:, :3], KernelBoundsError, "'out' must not share memory with 'captured'"),
    ]
    for out, error, match in bad_out:
        with pytest.raises(error, match=match):
            run(i, cap, out=out)
    assert torch.isnan(cap).all(), "a refused call writes nothing"
