"""The sampling rule's kernels on a GPU at Qwen3.5's vocabulary (skipped without CUDA):
the Gumbel-max draw and the top-p cut against their torch references, rows that do not
depend on the call, every output written, and unbiased frequencies.

Run: ``python -m pytest tests/gpu/test_sample_kernels.py -q -s``
"""

from __future__ import annotations

import math

import pytest
import torch

from dflash.kernels import gumbel_argmax, gumbel_argmax_reference
from dflash.kernels.sample_reference import gumbel_noise
from dflash.kernels.top_p import top_p_count
from dflash.kernels.top_p_reference import top_p_count_reference
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


def test_top_p_count_matches_the_reference_at_full_vocabulary() -> None:
    s = torch.sort(_logits(16, 1, torch.float32) / 0.7, dim=-1, descending=True).values
    out = torch.full((16,), POISON, dtype=torch.int64, device="cuda")
    got = top_p_count(s, 0.95, out=out)
    ref = top_p_count_reference(s, 0.95)
    assert got is out and (got >= 1).all()
    assert (got - ref).abs().max() <= 1, (got.tolist(), ref.tolist())
    print(f"\ntop_p_count: {int((got == ref).sum())}/16 rows equal the reference")


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
