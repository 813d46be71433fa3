"""The fused glue around the kernels: the residual add fed into the norm
(:func:`add_rms_norm`), a head's norm followed by the rotary embedding
(:func:`rms_norm_rotary`), an activation times a tensor (:func:`act_mul`), and the gated
norm reading a strided gate in place. Triton (interpreter) against the torch
formulation each replaces, with poisoned outputs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kernels_support import NAN, needs_interpreter, rel_rms

from dflash.errors import KernelBoundsError
from dflash.kernels import (
    act_mul,
    act_mul_reference,
    add_rms_norm,
    add_rms_norm_reference,
    rms_norm,
    rms_norm_reference,
    rms_norm_rotary,
    rms_norm_rotary_reference,
    rotary_reference,
)
from dflash.model.layers import apply_rotary

DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def poisoned(like: torch.Tensor) -> torch.Tensor:
    return torch.full(like.shape, NAN, dtype=like.dtype)


def rnd(*shape: int, scale: float = 1.0, seed: int, dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(dtype)


def same_or_close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    """16-bit results are the same bits; float32 ones within a few ulps (a fused
    multiply-add may round once where the torch formulation rounds twice)."""
    assert not got.isnan().any()
    if dtype == torch.float32:
        assert rel_rms(got, want) <= 1e-6
    else:
        assert torch.equal(got, want)


# -- add_rms_norm -------------------------------------------------------------------------


@needs_interpreter
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("D", [1, 40, 256])
def test_add_rms_norm_is_the_add_then_the_norm(dtype: torch.dtype, D: int) -> None:
    """``s`` is the add's bits (one rounding); ``y`` the Triton norm of ``s``, bit for bit."""
    x = rnd(2, 3, D, scale=3, seed=D, dtype=dtype)
    r = rnd(2, 3, D, scale=2, seed=D + 1, dtype=dtype)
    w = rnd(D, scale=0.2, seed=D + 2, dtype=dtype)
    out, sum_out = poisoned(x), poisoned(x)
    y, s = add_rms_norm(x, r, w, 1e-6, out=out, sum_out=sum_out, backend="triton")
    assert y is out and s is sum_out
    assert torch.equal(s, r + x)
    assert torch.equal(y, rms_norm(r + x, w, 1e-6, zero_centred=True, backend="triton"))
    ref_y, ref_s = add_rms_norm_reference(x, r, w, 1e-6, zero_centred=True)
    assert torch.equal(ref_s, r + x)
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    assert rel_rms(y, ref_y) <= tol


@needs_interpreter
def test_add_rms_norm_allocates_and_is_row_invariant() -> None:
    x = rnd(9, 64, scale=3, seed=1, dtype=torch.bfloat16)
    r = rnd(9, 64, seed=2, dtype=torch.bfloat16)
    w = rnd(64, scale=0.2, seed=3, dtype=torch.bfloat16)
    y, s = add_rms_norm(x, r, w, 1e-6, zero_centred=False, backend="triton")
    for i in range(9):
        yi, si = add_rms_norm(x[i : i + 1], r[i : i + 1], w, 1e-6, zero_centred=False,
                              backend="triton")
        assert torch.equal(yi[0], y[i]) and torch.equal(si[0], s[i])


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        ({"residual": [1.0]}, TypeError, "'residual' must be a torch.Tensor"),
        ({"residual": torch.ones(3, 2)}, KernelBoundsError, "'residual' must have shape"),
        ({"residual": torch.ones(2, 3, dtype=torch.float64)}, KernelBoundsError,
         "'residual' must be torch.float32 like 'x'"),
        ({"sum_out": torch.ones(2, 3, dtype=torch.float64)}, KernelBoundsError,
         "'sum_out' must be torch.float32"),
        ({"sum_out": "residual"}, KernelBoundsError,
         "'sum_out' must not share memory with 'residual'"),
        ({"out": "x"}, KernelBoundsError, "'out' must not share memory with 'x'"),
        ({"eps": -1.0}, KernelBoundsError, "'eps' must be a positive finite float"),
    ],
)
def test_add_rms_norm_bad_arguments_are_named(
    kwargs: dict[str, object], exc: type, match: str
) -> None:
    args: dict[str, object] = {"x": torch.ones(2, 3), "residual": torch.ones(2, 3),
                               "weight": torch.ones(3), "eps": 1e-6, "out": None,
                               "sum_out": None}
    args.update(kwargs)
    for key in ("out", "sum_out"):
        if isinstance(args[key], str):  # the name of the input it aliases
            args[key] = args[str(args[key])]
    with pytest.raises(exc, match=match):
        add_rms_norm(args["x"], args["residual"], args["weight"], args["eps"],  # type: ignore[arg-type]  # bad values on purpose
                     out=args["out"], sum_out=args["sum_out"])  # type: ignore[arg-type]  # as above


# -- rms_norm_rotary ----------------------------------------------------------------------


def _heads(dtype: torch.dtype, T: int, H: int, D: int, rd: int, seed: int
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``q`` as a head's query inside ``[query | gate]`` (a strided view), its weight and
    a rotary table of ``T`` positions."""
    qg = rnd(1, T, H, 2 * D, scale=2, seed=seed, dtype=dtype)
    w = rnd(D, scale=0.2, seed=seed + 1, dtype=dtype)
    angles = rnd(T, rd, scale=3, seed=seed + 2, dtype=torch.float32)
    return qg[..., :D], w, angles.cos().to(dtype), angles.sin().to(dtype)


@needs_interpreter
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("T", "H", "D", "rd"), [(1, 4, 32, 16), (5, 3, 32, 32), (3, 2, 24, 2)])
def test_rms_norm_rotary_is_the_norm_then_the_rotation(
    dtype: torch.dtype, T: int, H: int, D: int, rd: int
) -> None:
    """The same bits as the Triton norm followed by the model's rotation (16-bit), read
    in place from the strided query; the reference agrees with its own formulation."""
    q, w, cos, sin = _heads(dtype, T, H, D, rd, seed=T * 100 + D)
    out = poisoned(q)
    got = rms_norm_rotary(q, w, 1e-6, cos, sin, out=out, backend="triton")
    assert got is out and got.shape == q.shape
    normed = rms_norm(q.contiguous(), w, 1e-6, zero_centred=True, backend="triton")
    same_or_close(got, apply_rotary(normed, cos, sin), dtype)
    ref = rms_norm_rotary_reference(q, w, 1e-6, cos, sin, out=poisoned(q))
    want = apply_rotary(rms_norm_reference(q, w, 1e-6, zero_centred=True), cos, sin)
    assert torch.equal(ref, want)
    tol = 1e-6 if dtype == torch.float32 else 2e-2
    assert rel_rms(got, ref) <= tol


def test_rotary_reference_rotates_each_channel_pair() -> None:
    """The rotate-half formula, written out per channel pair (channel ``i`` with
    ``i + RD/2``, by the angle of each) in float64; channels past ``RD`` untouched."""
    x = rnd(2, 3, 4, 12, scale=2, seed=5, dtype=torch.float64)
    angles = rnd(3, 8, scale=3, seed=6, dtype=torch.float64)
    cos, sin = angles.cos(), angles.sin()
    got = rotary_reference(x, cos, sin)
    want = x.clone()
    for i in range(4):
        c, s = cos[:, None, :], sin[:, None, :]
        want[..., i] = x[..., i] * c[..., i] - x[..., i + 4] * s[..., i]
        want[..., i + 4] = x[..., i + 4] * c[..., i + 4] + x[..., i] * s[..., i + 4]
    assert torch.allclose(got, want, rtol=0, atol=1e-12)
    assert torch.equal(got[..., 8:], x[..., 8:])
    assert torch.equal(apply_rotary(x, cos, sin), got)  # the model's rotation is this one


@needs_interpreter
def test_rms_norm_rotary_copies_a_head_it_cannot_read_in_place() -> None:
    """An ``x`` whose channels are not contiguous (a transposed view) gives the bits of
    its contiguous copy."""
    q, w, cos, sin = _heads(torch.bfloat16, 3, 2, 16, 8, seed=9)
    strided = q.contiguous().transpose(-1, -2).contiguous().transpose(-1, -2)
    assert strided.stride(-1) != 1 and torch.equal(strided, q)
    got = rms_norm_rotary(strided, w, 1e-6, cos, sin, out=poisoned(q.contiguous()),
                          backend="triton")
    assert torch.equal(got, rms_norm_rotary(q.contiguous(), w, 1e-6, cos, sin,
                                            backend="triton"))


@needs_interpreter
def test_rms_norm_rotary_rows_are_tokens_and_heads() -> None:
    """Each (token, head) row takes its own token's cos/sin: a token alone gives its row
    of the whole call, and a batch of two is each batch row's call."""
    q, w, cos, sin = _heads(torch.bfloat16, 5, 3, 32, 16, seed=7)
    whole = rms_norm_rotary(q, w, 1e-6, cos, sin, backend="triton")
    for t in range(5):
        one = rms_norm_rotary(q[:, t : t + 1], w, 1e-6, cos[t : t + 1], sin[t : t + 1],
                              backend="triton")
        assert torch.equal(one[0, 0], whole[0, t]), f"token {t}"
    batch = torch.cat([q, q.flip(1)]).contiguous()
    two = rms_norm_rotary(batch, w, 1e-6, cos, sin, backend="triton")
    assert torch.equal(two[0], whole[0])
    assert torch.equal(two[1], rms_norm_rotary(q.flip(1).contiguous(), w, 1e-6, cos, sin,
                                               backend="triton")[0])


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"x": torch.ones(3, 8)}, "'x' must be \\[..., T, H, D\\]"),
        ({"cos": torch.ones(2, 4)}, "'cos' must be \\[T, RD\\] with T = 3"),
        ({"cos": torch.ones(3, 3), "sin": torch.ones(3, 3)}, "an even RD in \\[2, 8\\]"),
        ({"cos": torch.ones(3, 10), "sin": torch.ones(3, 10)}, "an even RD in \\[2, 8\\]"),
        ({"sin": torch.ones(3, 2)}, "'sin' must have shape cos's shape"),
        ({"cos": torch.ones(3, 4, dtype=torch.float64)}, "'cos' must be torch.float32"),
        ({"out": torch.ones(1, 3, 2, 8, dtype=torch.float16)}, "'out' must be torch.float32"),
    ],
)
def test_rms_norm_rotary_bad_arguments_are_named(kwargs: dict[str, object], match: str) -> None:
    args: dict[str, object] = {"x": torch.ones(1, 3, 2, 8), "cos": torch.ones(3, 4),
                               "sin": torch.ones(3, 4), "out": None}
    args.update(kwargs)
    with pytest.raises(KernelBoundsError, match=match):
        rms_norm_rotary(args["x"], torch.ones(8), 1e-6, args["cos"], args["sin"],  # type: ignore[arg-type]  # bad values on purpose
                        out=args["out"])  # type: ignore[arg-type]  # as above


# -- act_mul ------------------------------------------------------------------------------


@needs_interpreter
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("act", ["silu", "sigmoid"])
@pytest.mark.parametrize("N", [1, 50, 2500])
def test_act_mul_matches_the_two_launches(dtype: torch.dtype, act: str, N: int) -> None:
    """Column slices of one buffer (as the grouped projection gives them), more columns
    than one program's block: within a rounding of the activation's launch then the
    product's."""
    both = rnd(2, 3, 2 * N, scale=3, seed=N, dtype=dtype)
    gate, x = both[..., :N], both[..., N:]
    out = poisoned(x)
    got = act_mul(gate, x, act, out=out, backend="triton")  # type: ignore[arg-type]  # a valid name
    assert got is out
    a = F.silu(gate.double()) if act == "silu" else torch.sigmoid(gate.double())
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    assert rel_rms(got, (a.to(dtype).double() * x.double())) <= tol
    ref = act_mul_reference(gate, x, act, out=poisoned(x))  # type: ignore[arg-type]  # as above
    assert rel_rms(got, ref) <= tol
    assert torch.equal(ref, (F.silu(gate) if act == "silu" else torch.sigmoid(gate)) * x)
    if dtype != torch.float32:  # the activation rounded before the product: at most a
        # last-bit difference of the two exps in rare elements (unrounded: about 25 %)
        assert (got != ref).double().mean() <= 0.01


@needs_interpreter
def test_act_mul_rows_are_invariant_and_copies_read_the_same() -> None:
    """A row alone gives its row of the whole call; rows that do not collapse into one
    stride (a head's gate of several tokens) give the contiguous call's bits."""
    both = rnd(1, 6, 4, 32, scale=3, seed=5, dtype=torch.bfloat16)
    gate, x = both[..., :16], both[..., 16:].contiguous()
    whole = act_mul(gate, x, "sigmoid", backend="triton")
    assert torch.equal(whole, act_mul(gate.contiguous(), x, "sigmoid", backend="triton"))
    for t in range(6):
        one = act_mul(gate[:, t : t + 1], x[:, t : t + 1], "sigmoid", backend="triton")
        assert torch.equal(one[0, 0], whole[0, t])


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        ({"gate": [1.0]}, TypeError, "'gate' must be a torch.Tensor"),
        ({"gate": torch.ones(3, 2)}, KernelBoundsError, "'gate' must have shape"),
        ({"gate": torch.ones(2, 3, dtype=torch.float16)}, KernelBoundsError,
         "'gate' must be torch.float32"),
        ({"act": "relu"}, KernelBoundsError, "'act' must be one of silu, sigmoid"),
        ({"out": "x"}, KernelBoundsError, "'out' must not share memory with 'x'"),
        ({"out": torch.ones(3, 2).t()}, KernelBoundsError, "'out' must be contiguous"),
    ],
)
def test_act_mul_bad_arguments_are_named(kwargs: dict[str, object], exc: type, match: str) -> None:
    args: dict[str, object] = {"gate": torch.ones(2, 3), "x": torch.ones(2, 3), "act": "silu",
                               "out": None}
    args.update(kwargs)
    if isinstance(args["out"], str):
        args["out"] = args[str(args["out"])]
    with pytest.raises(exc, match=match):
        act_mul(args["gate"], args["x"], args["act"], out=args["out"])  # type: ignore[arg-type]  # bad values on purpose


# -- the gated norm's strided gate ----------------------------------------------------------


@needs_interpreter
def test_gated_norm_reads_a_strided_gate_in_place() -> None:
    """The gate as a column slice of a wider buffer gives the contiguous gate's bits."""
    x = rnd(1, 4, 32, scale=3, seed=1, dtype=torch.bfloat16)
    wide = rnd(1, 4, 80, seed=2, dtype=torch.bfloat16)
    z = wide[..., 16:48]
    w = rnd(32, seed=3, dtype=torch.bfloat16)
    got = rms_norm(x, w, 1e-6, zero_centred=False, gate=z, backend="triton")
    want = rms_norm(x, w, 1e-6, zero_centred=False, gate=z.contiguous(), backend="triton")
    assert torch.equal(got, want)
    ref = rms_norm_reference(x, w, 1e-6, zero_centred=False, gate=z)
    assert rel_rms(got, ref) <= 1e-2
