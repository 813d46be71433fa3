"""The tuned CPU references and the Triton kernels against the frozen naive oracles
(``dflash.kernels.naive``): the same outputs, states and captured rows, chains and trees,
grouped heads, with and without the l2 norm; every output NaN-poisoned first."""

from __future__ import annotations

import pytest
import torch
from kernels_support import NAN, gdn_inputs, nan_slots, needs_interpreter

from dflash.geometry import require_chain, require_tree
from dflash.kernels import causal_conv1d_capture, gdn_verify, gdn_verify_reference
from dflash.kernels.checks import Backend
from dflash.kernels.naive import conv_naive, gdn_naive

BACKENDS = ["reference", pytest.param("triton", marks=needs_interpreter)]
# (B, T, HK, HV, K, V, l2, parents): a chain, a tree with siblings, one token
GDN_CASES = [
    (2, 5, 1, 2, 8, 8, True, (-1, 0, 1, 2, 3)),
    (1, 6, 2, 4, 16, 8, True, (-1, 0, 0, 1, 2, 2)),
    (1, 4, 1, 3, 8, 16, False, (-1, 0, 1, 1)),
    (1, 1, 1, 1, 16, 16, True, (-1,)),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("B", "T", "HK", "HV", "K", "V", "l2", "parents"), GDN_CASES)
def test_gdn_matches_the_naive_recurrence(
    backend: Backend, B: int, T: int, HK: int, HV: int, K: int, V: int, l2: bool,
    parents: tuple[int, ...],
) -> None:
    i = gdn_inputs(B, T, HK, HV, K, V, torch.float32, seed=T * 10 + HV)
    chain = parents == tuple(range(-1, T - 1))
    geometry = require_chain(parents) if chain else require_tree(parents)
    ckpt = nan_slots(B, T + 2, HV, K, V, torch.float32)  # two slots past T stay NaN
    out = torch.full((B, T, HV, V), NAN)
    gdn_verify(i["q"], i["k"], i["v"], i["g"], i["beta"], i["initial_state"], ckpt, geometry,
               use_qk_l2norm=l2, out=out, backend=backend)
    o_want, states_want = gdn_naive(i["q"], i["k"], i["v"], i["g"], i["beta"],
                                    i["initial_state"], parents, use_qk_l2norm=l2)
    torch.testing.assert_close(out.double(), o_want, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(ckpt[:, :T].double(), states_want, rtol=2e-5, atol=2e-5)
    assert ckpt[:, T:].isnan().all()  # nothing past the draft's slots


def test_the_float64_reference_equals_the_oracle_closely() -> None:
    """In float64 (the reference itself: the entry point keeps states in float32) the tuned
    reference and the oracle differ by rounding only."""
    i = {n: t.double() for n, t in gdn_inputs(1, 6, 2, 4, 16, 8, torch.float32, 5).items()}
    parents = (-1, 0, 1, 1, 3, 0)
    ckpt = nan_slots(1, 6, 4, 16, 8, torch.float64)
    out = torch.full((1, 6, 4, 8), NAN, dtype=torch.float64)
    gdn_verify_reference(i["q"], i["k"], i["v"], i["g"], i["beta"], i["initial_state"], ckpt,
                         require_tree(parents), out=out)
    o_want, states_want = gdn_naive(i["q"], i["k"], i["v"], i["g"], i["beta"],
                                    i["initial_state"], parents)
    torch.testing.assert_close(out, o_want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ckpt, states_want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("T", "Kc", "bias", "activation"), [
    (1, 4, True, "silu"), (5, 4, False, "silu"), (3, 2, True, None), (7, 3, True, "silu"),
])
def test_conv_matches_the_naive_convolution(
    backend: Backend, T: int, Kc: int, bias: bool, activation: str | None
) -> None:
    B, C = 2, 24
    gen = torch.Generator().manual_seed(T * 7 + Kc)
    x = torch.randn(B, T, C, generator=gen) * 3.0  # wide enough to reach SiLU's tails
    rows = torch.randn(B, Kc - 1, C, generator=gen)
    weight = torch.randn(C, Kc, generator=gen)
    b = torch.randn(C, generator=gen) if bias else None
    captured = torch.full((B, Kc - 1 + T + 1, C), NAN)
    y = torch.full((B, T, C), NAN)
    causal_conv1d_capture(x, rows, weight, b, captured, activation=activation, out=y,
                          backend=backend)
    want = conv_naive(x, rows, weight, b, activation=activation)
    torch.testing.assert_close(y.double(), want, rtol=1e-5, atol=1e-5)
    assert torch.equal(captured[:, : Kc - 1 + T], torch.cat([rows, x], dim=1))
    assert captured[:, Kc - 1 + T :].isnan().all()
