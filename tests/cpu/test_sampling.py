"""The sampling rule (``dflash.sampling``): Philox bits, unbiased frequencies, exact filter
supports, rows that do not depend on the call, and the parameters' checks."""

from __future__ import annotations

import math

import pytest
import torch

from dflash.kernels.checks import INTERPRET, Backend
from dflash.sampling import (
    GREEDY,
    SamplingError,
    SamplingParams,
    gumbel_noise,
    philox,
    sample_tokens,
)

#: chi-square critical values at p = 0.001 by degrees of freedom (the test fails a sound
#: sampler once in a thousand seed sets; the seed sets below are fixed, so never)
CHI2_999 = {3: 16.27, 5: 20.52, 7: 24.32}


def draws(logits: torch.Tensor, params: SamplingParams, n: int, start: int = 0) -> torch.Tensor:
    """``n`` draws from one row of logits: the same row at positions ``start … start+n-1``
    (the noise at each position is independent of the others')."""
    rows = logits.expand(n, -1)
    return sample_tokens(rows, torch.arange(start, start + n), params)


def chi_square(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    counts = torch.bincount(tokens, minlength=probs.numel()).double()
    expected = probs.double() * tokens.numel()
    return float(((counts - expected) ** 2 / expected).sum())


@pytest.mark.skipif(not INTERPRET, reason="Triton's philox on CPU needs TRITON_INTERPRET=1")
def test_philox_is_tritons_philox4x32_10() -> None:
    """The torch Philox gives the bits of Triton's own ``tl.philox`` (first output word)
    for 64-bit seeds and 32-bit counters, so a device kernel can draw the same noise."""
    import triton
    import triton.language as tl

    @triton.jit  # type: ignore[untyped-decorator]  # triton ships no types
    def kernel(seed, c0, c1, out, N: tl.constexpr):  # type: ignore[no-untyped-def]  # Triton pointers
        o = tl.arange(0, N)
        a = tl.load(c0 + o).to(tl.uint32)
        b = tl.load(c1 + o).to(tl.uint32)
        z = tl.zeros([N], dtype=tl.uint32)
        r0, _, _, _ = tl.philox(seed, a, b, z, z)
        tl.store(out + o, r0.to(tl.int64) & 0xFFFFFFFF)

    gen = torch.Generator().manual_seed(0)
    c0 = torch.randint(0, 2**31, (64,), generator=gen)
    c1 = torch.randint(0, 2**31, (64,), generator=gen)
    c0[:4] = torch.tensor([0, 1, 2**31 - 1, 77])
    for seed in (0, 1, 12345, 2**40 + 7, 2**63 - 1):
        out = torch.zeros(64, dtype=torch.int64)
        kernel[(1,)](seed, c0, c1, out, N=64)
        assert torch.equal(philox(seed, c0, c1), out), f"seed {seed}"


@pytest.mark.parametrize("temperature", [1.0, 0.6, 1.7])
def test_frequencies_match_the_softmax(temperature: float) -> None:
    """6,000 draws of one 6-token distribution: the chi-square statistic against
    ``softmax(l / T)`` stays under its 0.999 quantile (5 degrees of freedom)."""
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]])
    params = SamplingParams(temperature=temperature, seed=42)
    tokens = draws(logits, params, 6000)
    probs = torch.softmax(logits[0] / temperature, -1)
    stat = chi_square(tokens, probs)
    assert stat < CHI2_999[5], f"chi-square {stat:.2f} at T={temperature}"


def test_a_biased_rule_fails_the_frequency_test() -> None:
    """The frequency test can fail: draws at twice the temperature (a biased sampler for
    the stated one) are rejected."""
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]])
    tokens = draws(logits, SamplingParams(temperature=2.0, seed=42), 6000)
    assert chi_square(tokens, torch.softmax(logits[0], -1)) > CHI2_999[5]


def test_every_seed_and_position_draws_its_own_noise() -> None:
    """Standard Gumbel noise: mean near the Euler-Mascheroni constant, variance near
    pi^2/6, and a different field for another seed or another position."""
    g = gumbel_noise(7, torch.arange(64), 4096)
    assert abs(float(g.mean()) - 0.5772) < 0.01
    assert abs(float(g.var()) - math.pi**2 / 6) < 0.03
    assert not torch.equal(g, gumbel_noise(8, torch.arange(64), 4096))
    assert not torch.equal(g[1:], g[:-1])
    assert torch.isfinite(g).all()


def test_filters_keep_exactly_their_support() -> None:
    """top-k keeps the k largest, top-p the smallest most-probable set reaching p, min-p
    the tokens at least min_p times as likely as the best: every kept token is drawn in
    4,000 draws, no other ever is."""
    logits = torch.tensor([[3.0, 2.5, 2.0, 1.0, 0.9, 0.0, -1.0, -2.0]])
    probs = torch.softmax(logits[0], -1)
    cases = {
        SamplingParams(temperature=1.0, top_k=3, seed=1): {0, 1, 2},
        # cumulative 0.399, 0.641, 0.789: the first three reach 0.7 (the third crosses it)
        SamplingParams(temperature=1.0, top_p=0.7, seed=2): {0, 1, 2},
        SamplingParams(temperature=1.0, min_p=0.1, seed=3): {
            v for v in range(8) if probs[v] >= 0.1 * probs[0]
        },
        SamplingParams(temperature=1.0, top_k=5, top_p=0.95, min_p=0.1, seed=4): {0, 1, 2, 3, 4},
    }
    # e^-2 = 0.135 and e^-2.1 = 0.122 pass 0.1, e^-3 = 0.050 does not
    assert cases[SamplingParams(temperature=1.0, min_p=0.1, seed=3)] == {0, 1, 2, 3, 4}
    for params, support in cases.items():
        seen = set(draws(logits, params, 4000).tolist())
        assert seen == support, params


def test_top_p_keeps_the_most_probable_token_even_alone() -> None:
    logits = torch.tensor([[5.0, 0.0, 0.0]])
    seen = set(draws(logits, SamplingParams(temperature=1.0, top_p=0.01, seed=0), 500).tolist())
    assert seen == {0}


def test_a_rows_token_does_not_depend_on_the_call() -> None:
    """Row ``i`` of a 16-row call equals a one-row call at the same position (with every
    filter on), and the same seed and position give the same token again."""
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(16, 300, generator=gen) * 3
    positions = torch.arange(100, 116)
    params = SamplingParams(temperature=0.8, top_k=40, top_p=0.9, min_p=0.02, seed=9)
    together = sample_tokens(logits, positions, params)
    alone = torch.cat([sample_tokens(logits[i : i + 1], positions[i : i + 1], params)
                       for i in range(16)])
    assert torch.equal(together, alone)
    assert torch.equal(together, sample_tokens(logits, positions, params))
    other = sample_tokens(logits, positions, SamplingParams(temperature=0.8, seed=10))
    assert not torch.equal(together, other)


def test_temperature_zero_is_the_argmax() -> None:
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(1))
    assert torch.equal(sample_tokens(logits, None, GREEDY), logits.argmax(-1))
    with pytest.raises(ValueError, match="needs one position per row"):
        sample_tokens(logits, None, SamplingParams(temperature=1.0))
    with pytest.raises(ValueError, match=r"got \(4,\) for 5 rows"):
        sample_tokens(logits, torch.arange(4), SamplingParams(temperature=1.0))


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"temperature": -0.1}, r"'temperature' must be a number in \[0.0, 100.0\] \(got -0.1\)"),
        ({"temperature": math.nan}, "'temperature'"),
        ({"temperature": True}, "'temperature'"),
        ({"top_p": 0.0}, r"'top_p' must be a number in \(0.0, 1.0\]"),
        ({"top_p": 1.5}, "'top_p'"),
        ({"min_p": -1.0}, "'min_p'"),
        ({"min_p": 1.01}, "'min_p'"),
        ({"top_k": -1}, r"'top_k' must be an int in \[0, 2147483647\] \(got -1\)"),
        ({"top_k": 2.0}, "'top_k'"),
        ({"seed": -5}, "'seed'"),
        ({"seed": 2**63}, "'seed'"),
    ],
)
def test_bad_parameters_are_named(change: dict[str, object], match: str) -> None:
    with pytest.raises(SamplingError, match=match):
        SamplingParams(**change)  # type: ignore[arg-type]  # bad values on purpose


def oracle_kept(row_logits: list[float], params: SamplingParams) -> list[int]:
    """The tokens the filters keep, by their definition in plain Python: the tokens ordered
    by float32 logit descending, then id; top-k's first ``k``; top-p's weights
    ``floor(exp(float64(s_v - m)) * 2**32)`` (``s`` the float32 scaled logits, ``m`` the
    first token's) kept while the weights before them sum below ``float32(top_p) * Z``;
    min-p's ``s_v >= m + float32(log(min_p))``."""
    def f32(x: float) -> float:
        return float(torch.tensor(x, dtype=torch.float32))

    it = f32(1.0 / params.temperature)
    row = [f32(x) + 0.0 for x in row_logits]
    s = [f32(x * it) for x in row]
    order = sorted(range(len(row)), key=lambda v: (-row[v], v))
    kept = order[: params.top_k] if 0 < params.top_k < len(row) else order
    m = s[order[0]]
    if params.top_p < 1.0:
        w = [math.floor(math.exp(f32(s[v] - m)) * 2**32) for v in kept]
        target = f32(params.top_p) * sum(w)
        n = max(1, sum(1 for j in range(len(kept)) if sum(w[:j]) < target))
        kept = kept[:n]
    if params.min_p > 0.0:
        low = f32(m + f32(math.log(params.min_p)))
        kept = [v for v in kept if s[v] >= low]
    return kept


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0, top_k=7, seed=0),
    SamplingParams(temperature=0.5, top_p=0.8, seed=0),
    SamplingParams(temperature=1.0, top_k=12, top_p=0.6, seed=0),
    SamplingParams(temperature=2.0, min_p=0.3, seed=0),
    SamplingParams(temperature=1.0, top_k=20, top_p=0.9, min_p=0.05, seed=0),
    SamplingParams(temperature=0.7, top_p=0.999, seed=0),
])
@pytest.mark.parametrize(("dtype", "backend"), [
    (torch.float32, "reference"),
    (torch.bfloat16, "reference"),
    pytest.param(torch.bfloat16, "triton", marks=pytest.mark.skipif(
        not INTERPRET, reason="the Triton histogram on CPU needs TRITON_INTERPRET=1")),
])
def test_floors_keep_the_defined_prefix_with_ties(
    params: SamplingParams, dtype: torch.dtype, backend: Backend
) -> None:
    """On rows full of ties (and both signs of zero), each floor keeps exactly the prefix
    the filters define (:func:`oracle_kept`): the torch reference in float32 and bfloat16,
    and the Triton histogram of the bfloat16 logits."""
    from dflash.kernels import filter_floors
    from dflash.sampling import inverse_temperature

    gen = torch.Generator().manual_seed(4)
    logits = (torch.randint(-6, 6, (8, 50), generator=gen) / 2).to(dtype)
    logits[0, :10] = -0.0  # -0.0 and +0.0 are the same logit
    logits[0, 10:20] = 0.0
    logits[1, 5] = -math.inf
    inv_t = inverse_temperature(params)
    floor, floor_id = filter_floors(
        logits, inv_t, params.top_k, params.top_p, params.min_p, backend=backend
    )
    l32 = logits.float()
    for r in range(8):
        row = l32[r].tolist()
        f, fid = float(floor[r]), int(floor_id[r])
        got = [v for v in range(50) if row[v] > f or (row[v] == f and v <= fid)]
        assert sorted(oracle_kept(row, params)) == got, r
