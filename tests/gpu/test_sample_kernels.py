"""The sampling rule's kernels on a GPU at Qwen3.5's vocabulary (skipped without CUDA):
the Gumbel-max draw and the filters' floors against their torch references, rows that do not
depend on the call, every output written, and unbiased frequencies.

Run: ``python -m pytest tests/gpu/test_sample_kernels.py -q -s``
"""

from __future__ import annotations

import math

import pytest
import torch

from dflash.kernels import filter_floors, gumbel_argmax, gumbel_argmax_reference
from dflash.kernels.sample_reference import gumbel_noise
from dflash.sampling import SamplingParams, sample_tokens

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
VOCAB = 248_320  # Qwen3.5's vocabulary
POISON = -7


def _logits(rows: int, seed: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn(rows, VOCAB, generator=gen, device="cuda") * 4).to(dtype)


def test_gumbel_argmax_matches_the_reference_at_full_vocabulary() -> None:
    logits = _logits(64, 0)
    positions = torch.arange(10_000, 10_064, device="cuda")
    inv_t = float(torch.tensor(1 / 0.7, dtype=torch.float32))
    out = torch.full((64,), POISON, dtype=torch.int64, device="cuda")
    got = gumbel_argmax(logits, positions, 12345, inv_t, out=out)
    ref = gumbel_argmax_reference(logits, positions, 12345, inv_t)
    assert got is out and (got != POISON).all()
    noisy = (logits.float() * inv_t).double() + gumbel_noise(12345, positions, VOCAB).double()
    top2 = noisy.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 1e-4
    assert int(clear.sum()) >= 60
    assert torch.equal(got[clear], ref[clear])
    print(f"\ngumbel_argmax: {int((got == ref).sum())}/64 rows equal the reference")


@pytest.mark.parametrize(("top_k", "top_p", "min_p"), [
    (50, 1.0, 0.0), (0, 0.95, 0.0), (20, 0.8, 0.0), (0, 1.0, 0.05), (50, 0.95, 0.05),
    (1000, 0.99, 0.0),
])
def test_filter_floors_match_the_reference_at_full_vocabulary(
    top_k: int, top_p: float, min_p: float
) -> None:
    """The Triton histogram's floors equal the sorting reference's on 64 bfloat16 rows at
    three temperatures: wide random rows and peaked ones (a few large logits)."""
    logits = _logits(64, 1)
    logits[32:] = (logits[32:].float() * 0.25).to(torch.bfloat16)
    logits[32:, :40] += 12.0
    for temperature in (0.6, 1.0, 1.5):
        inv_t = float(torch.tensor(1 / temperature, dtype=torch.float32))
        out = (torch.full((64,), math.nan, device="cuda"),
               torch.full((64,), POISON, dtype=torch.int64, device="cuda"))
        got = filter_floors(logits, inv_t, top_k, top_p, min_p, out=out, backend="triton")
        ref = filter_floors(logits, inv_t, top_k, top_p, min_p, backend="reference")
        assert got[0] is out[0] and not torch.isnan(got[0]).any() and (got[1] != POISON).all()
        assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1]), temperature
    alone = filter_floors(logits[40:41].clone(), inv_t, top_k, top_p, min_p)
    assert float(alone[0][0]) == float(got[0][40]) and int(alone[1][0]) == int(got[1][40])


def test_top_p_integers_are_the_references_on_the_gpu() -> None:
    """Top-p's table (every 16-bit pattern's weight, bucket and min-p flag) and the total
    mass ``Z`` the mass launches sum equal their torch references bit for bit on the GPU,
    at temperatures whose ``1 / T`` makes ``l * inv_t`` inexact: a launch compiled with
    ``l * inv_t - m`` fused into one rounding (an FMA) gives other weights."""
    from dflash.kernels import filter_triton as ft
    from dflash.kernels.filter_reference import top_p_table_reference, top_p_weights

    logits = _logits(16, 2)
    logits[8:] = (logits[8:].float() * 0.25).to(torch.bfloat16)  # flat rows: all weigh
    bits16 = logits.view(torch.int16)
    chunks = -(-VOCAB // ft.CHUNK)
    maxima = torch.empty(16, chunks * ft.GROUPS, dtype=torch.int32, device="cuda")
    hist = torch.empty(16, ft.NBINS, dtype=torch.int32, device="cuda")
    ft.filter_maxima_kernel[(16, chunks)](bits16, maxima, hist, VOCAB, chunks, BV=ft.CHUNK,
                                          SUB=ft.GROUPS, num_warps=4)
    l = logits.float() + 0.0
    top = l.max(-1).values
    for temperature in (0.6, 0.7, 1.5):
        inv_t = float(torch.tensor(1 / temperature, dtype=torch.float32))
        log_min_p = math.log(0.02)
        got = ft.launch_filter_nucleus(bits16, maxima, inv_t, 0.95, log_min_p, True)
        want = top_p_table_reference(top, inv_t, torch.bfloat16, log_min_p)
        differ = int((got["table"] != want).sum())
        assert differ == 0, f"{differ} table entries differ at T={temperature}"
        z = top_p_weights(l * inv_t, (top * inv_t)[:, None]).sum(-1)
        assert torch.equal(got["total"], z), temperature


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.7, seed=3),
    SamplingParams(temperature=1.0, top_k=50, top_p=0.95, min_p=0.02, seed=4),
    SamplingParams(temperature=0.6, top_p=0.9, seed=5),
])
def test_a_rows_token_does_not_depend_on_the_call(params: SamplingParams) -> None:
    """Row ``i`` of a 64-row call is the same token as a one-row call (a decode) and as
    row ``i`` of a 16-row call, with every filter."""
    logits = _logits(64, 2)
    positions = torch.arange(777, 841, device="cuda")
    together = sample_tokens(logits, positions, params)
    alone = torch.cat([sample_tokens(logits[i : i + 1], positions[i : i + 1], params)
                       for i in range(64)])
    sixteen = torch.cat([sample_tokens(logits[i : i + 16], positions[i : i + 16], params)
                         for i in range(0, 64, 16)])
    assert torch.equal(together, alone) and torch.equal(together, sixteen)


def test_frequencies_match_the_softmax_on_the_gpu() -> None:
    """6,000 draws of one 6-token distribution by the kernel: the chi-square statistic
    against ``softmax(l / T)`` stays under its 0.999 quantile (5 degrees of freedom)."""
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]], device="cuda")
    for temperature in (0.6, 1.0, 1.7):
        params = SamplingParams(temperature=temperature, seed=42)
        tokens = sample_tokens(logits.expand(6000, -1), torch.arange(6000, device="cuda"),
                               params)
        probs = torch.softmax(logits[0] / temperature, -1).double()
        counts = torch.bincount(tokens, minlength=6).double()
        stat = float(((counts - probs * 6000) ** 2 / (probs * 6000)).sum())
        assert stat < 20.52, f"chi-square {stat:.2f} at T={temperature}"


def test_filters_keep_exactly_their_support_on_the_gpu() -> None:
    logits = torch.tensor([[3.0, 2.5, 2.0, 1.0, 0.9, 0.0, -1.0, -2.0]], device="cuda")
    cases = {
        SamplingParams(temperature=1.0, top_k=3, seed=1): {0, 1, 2},
        SamplingParams(temperature=1.0, top_p=0.7, seed=2): {0, 1, 2},
        SamplingParams(temperature=1.0, min_p=0.1, seed=3): {0, 1, 2, 3, 4},
    }
    for params, support in cases.items():
        seen = sample_tokens(logits.expand(4000, -1), torch.arange(4000, device="cuda"),
                             params)
        assert set(seen.tolist()) == support, params
    assert math.isfinite(float(logits.sum()))
