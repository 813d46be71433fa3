"""M-invariant linear: Triton (interpreter) against the reference, row invariance in M on
both backends, NaN-poisoned outputs and argument checks."""

from __future__ import annotations

import pytest
import torch
from kernels_support import NAN, needs_interpreter, rel_rms

from dflash.kernels import linear, linear_reference
from dflash.kernels.checks import Backend
from dflash.kernels.linear_triton import LinearConfig, launch_linear, linear_config

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
