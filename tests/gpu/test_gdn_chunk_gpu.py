"""gdn_chunk_prefill at the real Qwen3.5 shapes on a GPU (skipped without CUDA): the chunked
Triton prefill against the token-by-token Triton prefill of ``gdn_verify``.

Run: ``python -m pytest tests/gpu/test_gdn_chunk_gpu.py -q``.
"""

from __future__ import annotations

import pytest
import torch

from dflash.kernels import gdn_verify
from dflash.kernels.gdn_chunk import gdn_chunk_prefill

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
NAN = float("nan")
K, V, HK = 128, 128, 16
SHAPES = {"qwen3.5-27b": 48, "qwen3.5-9b": 32}  # HV


def rel_rms(got: torch.Tensor, ref: torch.Tensor) -> float:
    g, r = got.double(), ref.double()
    if not torch.isfinite(g).all():
        return float("inf")
    return float((g - r).norm() / r.norm())


def check_against_token_prefill(
    device: str, T: int, HK: int, HV: int, K: int, V: int, chunk: int,
    precision: str = "ieee",
) -> None:
    """The chunked prefill (Triton, state a slot of a NaN pool, NaN ``out``) against the
    token-by-token prefill on the same device: outputs, final state, untouched pool slots,
    and a second run bit-identical (deterministic)."""
    gen = torch.Generator(device=device).manual_seed(T)

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=device)

    q, k, v = rnd(1, T, HK, K).bfloat16(), rnd(1, T, HK, K).bfloat16(), rnd(1, T, HV, V).bfloat16()
    g = torch.nn.functional.logsigmoid(rnd(1, T, HV) + 2.0)
    beta = torch.sigmoid(rnd(1, T, HV)).bfloat16()
    init = rnd(1, HV, K, V) * 0.5

    token_state = init.clone()
    want = gdn_verify(q, k, v, g, beta, token_state, token_state.unsqueeze(1), None,
                      final_state_only=True, backend="triton")
    results = []
    for _ in range(2):
        pool = torch.full((1, 3, HV, K, V), NAN, device=device)
        pool[:, 1] = init
        out = torch.full_like(v, NAN)
        o = gdn_chunk_prefill(q, k, v, g, beta, pool[:, 1], chunk=chunk, out=out,
                              backend="triton", precision=precision)
        assert o is out
        assert torch.isnan(pool[:, 0]).all() and torch.isnan(pool[:, 2]).all()
        results.append((o, pool[:, 1]))
    (o, state), (o2, state2) = results
    assert rel_rms(o, want) <= 1e-2  # both rounded to bfloat16
    # tf32 products round their inputs to 10-bit mantissas (2^-11 relative)
    assert rel_rms(state, token_state) <= (1e-4 if precision == "ieee" else 5e-3)
    assert torch.equal(o, o2) and torch.equal(state, state2), "not deterministic"


@pytest.mark.parametrize("HV", SHAPES.values(), ids=SHAPES.keys())
@pytest.mark.parametrize("chunk", [64, 32])
def test_chunked_prefill_matches_the_token_prefill(HV: int, chunk: int) -> None:
    check_against_token_prefill("cuda", 1000, HK, HV, K, V, chunk)  # a partial last chunk


@pytest.mark.parametrize("chunk", [64, 32])
def test_chunked_prefill_in_tf32_stays_close(chunk: int) -> None:
    check_against_token_prefill("cuda", 1000, HK, SHAPES["qwen3.5-9b"], K, V, chunk, "tf32")
