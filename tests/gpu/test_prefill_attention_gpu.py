"""Prefill attention on a GPU (skipped without CUDA): the Triton kernel against the float64
reference for every supported dtype and several head dims, chunks equal to one call,
deterministic reruns, and a 32k-token chunk whose peak memory is the output alone.

Run: ``python -m pytest tests/gpu/test_prefill_attention_gpu.py -q``
"""

from __future__ import annotations

import pytest
import torch

from dflash.kernels.prefill_attention import prefill_attention
from dflash.kernels.prefill_attention_reference import prefill_attention_reference

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
NAN = float("nan")
H, HKV = 16, 2
#: relative RMS error against the float64 reference, per input dtype
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}


def rel_rms(got: torch.Tensor, ref: torch.Tensor) -> float:
    g, r = got.double(), ref.double()
    if not torch.isfinite(g).all():
        return float("inf")
    return float((g - r).norm() / r.norm())


def _inputs(T: int, start: int, D: int, dtype: torch.dtype, seed: int, spare: int = 64
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q and caches on the GPU, NaN in the ``spare`` cache rows past the chunk."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    S_max = start + T + spare
    q = (torch.randn(1, T, H, D, generator=gen, device="cuda") * 2).to(dtype)
    k = torch.randn(1, HKV, S_max, D, generator=gen, device="cuda").to(dtype)
    v = torch.randn(1, HKV, S_max, D, generator=gen, device="cuda").to(dtype)
    k[:, :, start + T :] = NAN
    v[:, :, start + T :] = NAN
    return q, k, v


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int) -> torch.Tensor:
    return prefill_attention_reference(q.double(), k.double(), v.double(), start)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize(("T", "start"), [(1, 0), (1, 777), (300, 0), (1000, 333)])
def test_matches_float64_reference(T: int, start: int, dtype: torch.dtype) -> None:
    q, k, v = _inputs(T, start, 256, dtype, seed=T + start)
    out = torch.full_like(q, NAN)
    got = prefill_attention(q, k, v, start, out=out, backend="triton")
    assert got is out
    assert rel_rms(got, _reference(q, k, v, start)) <= TOL[dtype]


@pytest.mark.parametrize("D", [64, 96, 128, 200])
def test_head_dims(D: int) -> None:
    q, k, v = _inputs(257, 100, D, torch.bfloat16, seed=D)
    got = prefill_attention(q, k, v, 100, out=torch.full_like(q, NAN), backend="triton")
    assert rel_rms(got, _reference(q, k, v, 100)) <= TOL[torch.bfloat16]


def test_chunks_equal_one_call_and_reruns_are_identical() -> None:
    q, k, v = _inputs(1124, 0, 256, torch.bfloat16, seed=5)
    whole = prefill_attention(q, k, v, 0, backend="triton")
    assert torch.equal(prefill_attention(q, k, v, 0, backend="triton"), whole)
    pieces, start = [], 0
    for n in (512, 1, 511, 100):
        pieces.append(prefill_attention(q[:, start : start + n], k, v, start, backend="triton"))
        start += n
    assert rel_rms(torch.cat(pieces, dim=1), whole) <= TOL[torch.bfloat16]


def test_long_chunk_allocates_only_its_output() -> None:
    """T = 32768 at D = 128: a [T, T] boolean mask per call would be 1 GiB and float32
    scores 64 GiB; the kernel's peak is the 128 MiB output. Its last 64 rows equal the
    reference's (a 64-row chunk at T - 64 sees exactly the same keys)."""
    T = 32768
    q, k, v = _inputs(T, 0, 128, torch.bfloat16, seed=9)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    got = prefill_attention(q, k, v, 0, backend="triton")
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - before
    assert extra <= got.numel() * got.element_size() + (4 << 20)
    tail = _reference(q[:, -64:], k, v, T - 64)
    assert rel_rms(got[:, -64:], tail) <= TOL[torch.bfloat16]
