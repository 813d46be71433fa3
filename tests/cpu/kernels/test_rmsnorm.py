"""Fused RMSNorm: Triton (interpreter) against the torch reference, and argument checks."""

from __future__ import annotations

import pytest
import torch
from kernels_support import NAN, needs_interpreter, rel_rms

from dflash.errors import KernelBoundsError
from dflash.kernels import rms_norm, rms_norm_reference
from dflash.kernels.checks import Backend


def poisoned(like: torch.Tensor) -> torch.Tensor:
    """An ``out=`` tensor full of NaN: a row the kernel does not write stays NaN."""
    return torch.full_like(like, NAN, memory_format=torch.contiguous_format)


def _inputs(rows: int, D: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, D, generator=gen) * 3).to(dtype)
    w = (torch.randn(D, generator=gen) * 0.2).to(dtype)
    z = torch.randn(rows, D, generator=gen).to(dtype)
    return x, w, z


@needs_interpreter
@pytest.mark.parametrize("D", [1, 48, 100, 256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("zero_centred", "gated"), [(True, False), (False, True), (False, False)])
def test_triton_matches_reference(
    D: int, dtype: torch.dtype, zero_centred: bool, gated: bool
) -> None:
    x, w, z = _inputs(7, D, dtype, seed=D)
    gate = z if gated else None
    ref = rms_norm_reference(x.double(), w.double(), 1e-6, zero_centred=zero_centred,
                             gate=None if gate is None else gate.double(),
                             out=poisoned(x.double()))
    out = poisoned(x)
    got = rms_norm(x, w, 1e-6, zero_centred=zero_centred, gate=gate, out=out, backend="triton")
    assert got is out and got.dtype == dtype and got.shape == x.shape
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    assert rel_rms(got, ref) <= tol


@needs_interpreter
def test_rows_are_batch_invariant() -> None:
    """A row's result is the same bits whether it is normalised alone or among others."""
    x, w, z = _inputs(9, 64, torch.bfloat16, seed=3)
    together = rms_norm(x, w, 1e-6, zero_centred=False, gate=z, out=poisoned(x),
                        backend="triton")
    assert not together.isnan().any()
    for r in range(x.shape[0]):
        alone = rms_norm(x[r : r + 1], w, 1e-6, zero_centred=False, gate=z[r : r + 1],
                         out=poisoned(x[r : r + 1]), backend="triton")
        assert torch.equal(alone[0], together[r])


@needs_interpreter
@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_every_row_is_written(backend: Backend) -> None:
    """Each row of a 3-D input (leading dims collapsed into rows) equals the formula."""
    x, w, _ = _inputs(5, 33, torch.float32, seed=4)
    x3 = x.view(5, 1, 33)
    out = poisoned(x3)
    got = rms_norm(x3, w, 1e-6, zero_centred=True, out=out, backend=backend)
    assert got is out and got.shape == (5, 1, 33)
    x64 = x3.double()
    expect = x64 / x64.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt() * (1 + w.double())
    for r in range(5):
        assert rel_rms(got[r], expect[r]) <= 1e-6, f"row {r}"


@needs_interpreter
@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_out_none_allocates_the_same_result(backend: Backend) -> None:
    x, w, z = _inputs(3, 40, torch.bfloat16, seed=6)
    out = poisoned(x)
    into = rms_norm(x, w, 1e-6, zero_centred=False, gate=z, out=out, backend=backend)
    fresh = rms_norm(x, w, 1e-6, zero_centred=False, gate=z, backend=backend)
    assert into is out and fresh is not out
    assert not into.isnan().any() and torch.equal(fresh, into)


def test_reference_matches_the_defining_formula() -> None:
    x, w, z = _inputs(4, 16, torch.float64, seed=5)
    rms = x.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt()
    expect = x / rms * (1 + w)
    got = rms_norm_reference(x, w, 1e-6, zero_centred=True, out=poisoned(x))
    assert torch.allclose(got, expect)
    gated = w * (x / rms) * torch.nn.functional.silu(z)
    got = rms_norm_reference(x, w, 1e-6, zero_centred=False, gate=z, out=poisoned(x))
    assert torch.allclose(got, gated)


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        ({"x": [1.0]}, TypeError, "'x' must be a torch.Tensor"),
        ({"x": torch.ones(2, 3, dtype=torch.int32)}, ValueError, "'x' must be a floating"),
        ({"weight": torch.ones(4)}, ValueError, "'weight' must have shape"),
        ({"gate": torch.ones(2, 4)}, ValueError, "'gate' must have shape"),
        ({"eps": 0.0}, ValueError, "'eps' must be a positive finite float"),
        ({"eps": float("nan")}, ValueError, "'eps' must be a positive finite float"),
        ({"backend": "cuda"}, ValueError, "'backend' must be"),
        ({"out": [[0.0] * 3] * 2}, TypeError, "'out' must be a torch.Tensor or None"),
        ({"out": torch.ones(3, 2)}, KernelBoundsError, "'out' must have shape x's shape"),
        ({"out": torch.ones(2, 3, dtype=torch.float64)}, KernelBoundsError,
         "'out' must be torch.float32 like the result"),
        ({"out": torch.ones(3, 2).t()}, KernelBoundsError, "'out' must be contiguous"),
        ({"out": torch.ones(2, 3, device="meta")}, KernelBoundsError, "'out' is on meta"),
        ({"out": "x"}, KernelBoundsError, "'out' must not share memory with 'x'"),
    ],
)
def test_bad_arguments_are_named(kwargs: dict[str, object], exc: type, match: str) -> None:
    args: dict[str, object] = {"x": torch.ones(2, 3), "weight": torch.ones(3), "eps": 1e-6}
    args.update(kwargs)
    if isinstance(args.get("out"), str):  # the name of the input that 'out' aliases
        args["out"] = args[str(args["out"])]
    gate = args.pop("gate", None)
    out = args.pop("out", None)
    backend = args.pop("backend", "reference")
    before = None if not isinstance(out, torch.Tensor) or out.is_meta else out.clone()
    with pytest.raises(exc, match=match):
        rms_norm(args["x"], args["weight"], args["eps"], zero_centred=True,  # type: ignore[arg-type]  # bad values on purpose
                 gate=gate, out=out, backend=backend)  # type: ignore[arg-type]  # as above
    if before is not None:  # a refused call writes nothing
        assert isinstance(out, torch.Tensor) and torch.equal(out, before)
