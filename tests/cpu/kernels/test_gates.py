"""Gated DeltaNet's gates: Triton (interpreter) against the torch reference, and checks."""

from __future__ import annotations

import pytest
import torch
from kernels_support import NAN, needs_interpreter, rel_rms

from dflash.errors import KernelBoundsError
from dflash.kernels import gdn_gates, gdn_gates_reference
from dflash.kernels.checks import Backend


def _inputs(
    rows: int, HV: int, dtype: torch.dtype, seed: int, width: int | None = None
) -> tuple[torch.Tensor, ...]:
    """a, b as column slices of a wider [rows, width] buffer (the grouped projection's
    output), with values across softplus' three regimes (x < -15, |x| small, x > 20)."""
    gen = torch.Generator().manual_seed(seed)
    width = width or 2 * HV + 5
    buf = torch.randn(rows, width, generator=gen) * 12
    buf[0, 3 : 3 + HV], buf[1, 3 : 3 + HV] = 40.0, -40.0  # both softplus tails, every HV
    buf = buf.to(dtype)
    a, b = buf[:, 3 : 3 + HV], buf[:, 3 + HV : 3 + 2 * HV]
    A_log = (torch.randn(HV, generator=gen) * 0.5).to(dtype)
    dt_bias = (torch.randn(HV, generator=gen) * 4).to(dtype)
    return a, b, A_log, dt_bias


def _poisoned(a: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.full(a.shape, NAN, dtype=dtype)


@needs_interpreter
@pytest.mark.parametrize("HV", [1, 4, 32, 48])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_matches_reference(HV: int, dtype: torch.dtype) -> None:
    a, b, A_log, dt_bias = _inputs(9, HV, dtype, seed=HV)
    want_beta, want_g = gdn_gates_reference(a.double(), b.double(), A_log.double(),
                                            dt_bias.double())
    beta_out, g_out = _poisoned(a, dtype), _poisoned(a, torch.float32)
    beta, g = gdn_gates(a, b, A_log, dt_bias, beta_out=beta_out, g_out=g_out, backend="triton")
    assert beta is beta_out and g is g_out and beta.dtype == dtype and g.dtype == torch.float32
    assert not beta.isnan().any() and not g.isnan().any()
    assert rel_rms(g, want_g) <= 1e-6
    assert rel_rms(beta, want_beta) <= (1e-6 if dtype == torch.float32 else 1e-2)
    # every element to a few ulps, in all of softplus' regimes: x > 20 (x itself), very
    # negative x (exp(x), not 0), and in between (log1p, not log(1 + e))
    x = a.double() + dt_bias.double()
    assert (x > 20).any() and (x < -15).any()
    # (rtol 5e-6: x = a + dt_bias itself rounds to float32, ulp(40) / 2 = 1.9e-6 of exp(x))
    torch.testing.assert_close(g.double(), want_g, rtol=5e-6, atol=0)
    _, f32_g = gdn_gates_reference(a.float(), b.float(), A_log.float(), dt_bias.float())
    torch.testing.assert_close(g, f32_g, rtol=1e-6, atol=0)  # the torch float32 formulation


@needs_interpreter
def test_rows_are_batch_invariant() -> None:
    a, b, A_log, dt_bias = _inputs(16, 32, torch.bfloat16, seed=7)
    beta_all, g_all = gdn_gates(a, b, A_log, dt_bias, backend="triton")
    for r in range(16):
        beta, g = gdn_gates(a[r : r + 1], b[r : r + 1], A_log, dt_bias, backend="triton")
        assert torch.equal(beta[0], beta_all[r]) and torch.equal(g[0], g_all[r])


@pytest.mark.parametrize("backend", ["reference", pytest.param("triton", marks=needs_interpreter)])
def test_three_dimensional_inputs_and_every_element_written(backend: Backend) -> None:
    a, b, A_log, dt_bias = _inputs(6, 4, torch.float32, seed=2)
    a3, b3 = a.view(2, 3, 4), b.view(2, 3, 4)
    beta_out, g_out = _poisoned(a3, torch.float32), _poisoned(a3, torch.float32)
    beta, g = gdn_gates(a3, b3, A_log, dt_bias, beta_out=beta_out, g_out=g_out,
                        backend=backend)
    want_beta, want_g = gdn_gates_reference(a3, b3, A_log, dt_bias)
    torch.testing.assert_close(beta, want_beta, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(g, want_g, rtol=1e-6, atol=0)


def test_bad_arguments_are_named() -> None:
    a, b, A_log, dt_bias = _inputs(4, 8, torch.float32, seed=1)
    with pytest.raises(TypeError, match="'a'"):
        gdn_gates([1.0], b, A_log, dt_bias)  # type: ignore[arg-type]
    with pytest.raises(KernelBoundsError, match="'b' must have shape"):
        gdn_gates(a, b[:, :4], A_log, dt_bias)
    with pytest.raises(KernelBoundsError, match=r"'b' must be torch\.float32"):
        gdn_gates(a, b.to(torch.bfloat16), A_log, dt_bias)
    with pytest.raises(KernelBoundsError, match="'A_log' must have shape"):
        gdn_gates(a, b, A_log[:3], dt_bias)
    with pytest.raises(KernelBoundsError, match="'dt_bias' must have 1 dimensions"):
        gdn_gates(a, b, A_log, dt_bias[None])
    with pytest.raises(KernelBoundsError, match="'a' must have a contiguous last dimension"):
        gdn_gates(a.t().contiguous().t(), b, A_log, dt_bias)
    with pytest.raises(KernelBoundsError, match=r"'g_out' must be torch\.float32"):
        gdn_gates(a, b, A_log, dt_bias, g_out=torch.empty(4, 8, dtype=torch.bfloat16))
    own = a.contiguous()
    with pytest.raises(KernelBoundsError, match="'beta_out' must not share memory with 'a'"):
        gdn_gates(own, b, A_log, dt_bias, beta_out=own)
