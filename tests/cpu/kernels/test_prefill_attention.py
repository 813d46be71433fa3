"""Chunked-prefill attention: the reference against a dense float64 oracle (GQA, T = 1,
start 0, odd starts and head dims, the reference's query blocks), Triton (interpreter)
against the reference with NaN-poisoned outputs and caches poisoned past the chunk, a
sequence run in chunks equal to one call, start 0 equal to SDPA, strided cache views, the
tile configuration and argument checks."""

from __future__ import annotations

import importlib
import math

import pytest
import torch
import torch.nn.functional as F
from kernels_support import NAN, needs_interpreter, rel_rms

from dflash.errors import KernelBoundsError
from dflash.kernels.checks import Backend
from dflash.kernels.prefill_attention import prefill_attention
from dflash.kernels.prefill_attention_reference import prefill_attention_reference
from dflash.kernels.prefill_attention_triton import (
    PrefillConfig,
    launch_prefill_attention,
    prefill_config,
)

#: the reference's module (its block sizes are patched; the package exports a function of
#: the same name)
reference_module = importlib.import_module("dflash.kernels.prefill_attention_reference")
#: relative RMS error against a float64 result, per input dtype
TOL = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}
BACKENDS = ["reference", pytest.param("triton", marks=needs_interpreter)]
#: the smallest tiles: many query tiles and key blocks at small sizes
SMALL = PrefillConfig(block_m=16, block_n=16, num_warps=4, num_stages=2)

#: (B, T, H, HKV, D, start)
CASES = [
    (1, 1, 2, 1, 32, 0),        # one token at position 0
    (1, 1, 4, 2, 16, 23),       # one token deep in the cache, GQA
    (2, 9, 4, 2, 32, 0),        # start 0, GQA, two batch rows
    (1, 40, 6, 2, 96, 37),      # G = 3, D not a power of two, start off every block
    (2, 17, 3, 3, 64, 64),      # one query head per KV head, start on a block boundary
    (1, 20, 2, 1, 32, 30),      # tiles start one key before a block boundary
    (1, 3, 4, 2, 256, 5),       # the largest head dim
]


def _inputs(B: int, T: int, H: int, HKV: int, D: int, start: int, dtype: torch.dtype,
            seed: int, spare: int = 5) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q and caches with ``spare`` rows past the chunk, NaN there (never to be read)."""
    gen = torch.Generator().manual_seed(seed)
    S_max = start + T + spare
    q = (torch.randn(B, T, H, D, generator=gen) * 2).to(dtype)
    k = torch.randn(B, HKV, S_max, D, generator=gen).to(dtype)
    v = torch.randn(B, HKV, S_max, D, generator=gen).to(dtype)
    k[:, :, start + T :] = NAN
    v[:, :, start + T :] = NAN
    return q, k, v


def _dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int,
           scale: float | None = None) -> torch.Tensor:
    """The oracle: float64, every query head given its own copy of its KV head, one
    softmax over the full ``[T, start + T]`` causal mask."""
    _, T, H, D = q.shape
    G = H // k.shape[1]
    kv_head = torch.arange(H) // G
    keys = k[:, kv_head, : start + T].double()              # [B, H, start + T, D]
    values = v[:, kv_head, : start + T].double()
    scores = torch.einsum("bthd,bhsd->bhts", q.double(), keys)
    scores = scores * (D**-0.5 if scale is None else scale)
    hidden = torch.arange(start + T)[None, :] > start + torch.arange(T)[:, None]
    scores = scores.masked_fill(hidden, -math.inf)
    return torch.einsum("bhts,bhsd->bthd", scores.softmax(-1), values)


def _poisoned_out(q: torch.Tensor) -> torch.Tensor:
    return torch.full(q.shape, NAN, dtype=q.dtype)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize(("B", "T", "H", "HKV", "D", "start"), CASES)
def test_reference_matches_dense_oracle(B: int, T: int, H: int, HKV: int, D: int,
                                        start: int, dtype: torch.dtype) -> None:
    q, k, v = _inputs(B, T, H, HKV, D, start, dtype, seed=T + D)
    out = _poisoned_out(q)
    got = prefill_attention_reference(q, k, v, start, out=out)
    assert got is out
    assert rel_rms(got, _dense(q, k, v, start)) <= TOL[dtype]


def test_reference_crosses_its_query_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    """T = 300 at start 37 spans two default 256-row blocks; blocks of 7 rows and a score
    budget that leaves one row per block give the same result."""
    q, k, v = _inputs(1, 300, 4, 2, 16, 37, torch.float64, seed=3)
    dense = _dense(q, k, v, 37)
    assert rel_rms(prefill_attention_reference(q, k, v, 37), dense) <= TOL[torch.float64]
    monkeypatch.setattr(reference_module, "QUERY_BLOCK", 7)
    assert rel_rms(prefill_attention_reference(q, k, v, 37), dense) <= TOL[torch.float64]
    monkeypatch.setattr(reference_module, "SCORE_ELEMENTS", 1)
    got = prefill_attention_reference(q[:, :20], k, v, 37)
    assert rel_rms(got, _dense(q[:, :20], k, v, 37)) <= TOL[torch.float64]


@needs_interpreter
@pytest.mark.parametrize("config", [None, SMALL], ids=["default", "small_tiles"])
@pytest.mark.parametrize(("B", "T", "H", "HKV", "D", "start"), CASES)
def test_triton_matches_reference(B: int, T: int, H: int, HKV: int, D: int, start: int,
                                  config: PrefillConfig | None) -> None:
    q, k, v = _inputs(B, T, H, HKV, D, start, torch.float32, seed=T + H)
    out = _poisoned_out(q)
    got = launch_prefill_attention(q, k, v, start, D**-0.5, out, config=config)
    assert got is out
    ref = prefill_attention_reference(q.double(), k.double(), v.double(), start)
    assert rel_rms(got, ref) <= TOL[torch.float32]


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_triton_half_precision(dtype: torch.dtype) -> None:
    """G = 3 over 16-row tiles (tiles split positions' heads), D = 96, start 21."""
    q, k, v = _inputs(2, 23, 6, 2, 96, 21, dtype, seed=8)
    out = _poisoned_out(q)
    got = launch_prefill_attention(q, k, v, 21, 96**-0.5, out, config=SMALL)
    ref = prefill_attention_reference(q.double(), k.double(), v.double(), 21)
    assert got.dtype == dtype
    assert rel_rms(got, ref) <= TOL[dtype]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("chunks", [[1] * 6 + [39], [7, 13, 25], [16, 16, 13], [44, 1]])
def test_chunks_equal_one_call(backend: Backend, chunks: list[int]) -> None:
    """A 45-token sequence run chunk by chunk, each chunk writing its keys and values into
    a NaN-filled cache before attending, equals one call over the whole sequence."""
    L, H, HKV, D = sum(chunks), 4, 2, 32
    q, k, v = _inputs(1, L, H, HKV, D, 0, torch.float32, seed=len(chunks), spare=3)
    whole = prefill_attention(q, k, v, 0, out=_poisoned_out(q), backend=backend)
    k_cache, v_cache = torch.full_like(k, NAN), torch.full_like(v, NAN)
    pieces, start = [], 0
    for n in chunks:
        k_cache[:, :, start : start + n] = k[:, :, start : start + n]
        v_cache[:, :, start : start + n] = v[:, :, start : start + n]
        chunk_q = q[:, start : start + n]
        pieces.append(prefill_attention(chunk_q, k_cache, v_cache, start,
                                        out=_poisoned_out(chunk_q), backend=backend))
        start += n
    assert rel_rms(torch.cat(pieces, dim=1), whole) <= TOL[torch.float32]


@pytest.mark.parametrize("backend", BACKENDS)
def test_start_zero_equals_sdpa(backend: Backend) -> None:
    B, T, H, HKV, D = 2, 21, 6, 2, 32
    q, k, v = _inputs(B, T, H, HKV, D, 0, torch.float32, seed=4)
    got = prefill_attention(q, k, v, 0, out=_poisoned_out(q), backend=backend)
    G = H // HKV
    keys = k[:, :, :T].repeat_interleave(G, dim=1)          # [B, H, T, D]
    values = v[:, :, :T].repeat_interleave(G, dim=1)
    sdpa = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, is_causal=True)
    assert rel_rms(got, sdpa.transpose(1, 2)) <= TOL[torch.float32]


@pytest.mark.parametrize("backend", BACKENDS)
def test_hand_checked_two_keys(backend: Backend) -> None:
    """scale 1, q = [1, 0] at positions 1 and 2 over k0 = [0, 0], k1 = [ln 3, 0],
    k2 = [0, 0]: row 0 weighs v0, v1 by [1/4, 3/4]; row 1 weighs v0, v1, v2 by
    [1/5, 3/5, 1/5]. Row 3 of the cache is NaN."""
    q = torch.tensor([[1.0, 0.0], [1.0, 0.0]]).view(1, 2, 1, 2)
    k = torch.tensor([[0.0, 0.0], [math.log(3.0), 0.0], [0.0, 0.0], [NAN, NAN]])
    v = torch.tensor([[4.0, 0.0], [0.0, 8.0], [1.0, 1.0], [NAN, NAN]])
    got = prefill_attention(q, k.view(1, 1, 4, 2), v.view(1, 1, 4, 2), 1, scale=1.0,
                            out=_poisoned_out(q), backend=backend)
    expect = torch.tensor([[1.0, 6.0], [1.0, 5.0]]).view(1, 2, 1, 2)
    assert torch.allclose(got, expect, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_strided_cache_views(backend: Backend) -> None:
    """Caches given as layer 1 of a stacked [L, B, HKV, S_max, D] buffer (layers 0 and 2
    NaN), q and out views of wider buffers: the values of contiguous copies, and the
    output buffer's other columns untouched."""
    q, k, v = _inputs(2, 11, 4, 2, 32, 13, torch.float32, seed=6)
    stack_k = torch.stack([torch.full_like(k, NAN), k, torch.full_like(k, NAN)])
    stack_v = torch.stack([torch.full_like(v, NAN), v, torch.full_like(v, NAN)])
    q_and_gate = torch.cat([q, torch.full_like(q, NAN)], dim=-1)     # [B, T, H, 2 * D]
    buf = torch.full((2, 11, 4, 48), NAN)
    got = prefill_attention(q_and_gate[..., :32], stack_k[1], stack_v[1], 13,
                            out=buf[..., :32], backend=backend)
    assert rel_rms(got, _dense(q, k, v, 13)) <= TOL[torch.float32]
    assert torch.isnan(buf[..., 32:]).all()


def test_config_shrinks_the_query_tile_for_short_chunks() -> None:
    assert prefill_config(128, 1, 2) == PrefillConfig(16, 64, 4, 3)
    assert prefill_config(128, 40, 2).block_m == 64
    assert prefill_config(256, 4096, 2) == PrefillConfig(128, 64, 8, 2)
    assert prefill_config(64, 4096, 2).block_m == 128
    assert prefill_config(256, 4096, 4) == PrefillConfig(32, 16, 8, 2)


def _bad_args() -> list[tuple[dict[str, object], type, str]]:
    return [
        ({"q": [1.0]}, TypeError, "'q' must be a torch.Tensor"),
        ({"q": torch.ones(1, 2, 4)}, KernelBoundsError, "'q' must have 4 dimensions"),
        ({"q": torch.ones(1, 2, 4, 8, dtype=torch.int32)}, KernelBoundsError,
         "'q' must be a floating"),
        ({"q": torch.ones(1, 0, 4, 8)}, KernelBoundsError, "'q' must have B, T, H, D >= 1"),
        ({"k_cache": "cache"}, TypeError, "'k_cache' must be a torch.Tensor"),
        ({"k_cache": torch.ones(1, 2, 16, 4)}, KernelBoundsError, "'k_cache' must have shape"),
        ({"k_cache": torch.ones(2, 2, 16, 8)}, KernelBoundsError, "'k_cache' must have shape"),
        ({"k_cache": torch.ones(1, 3, 16, 8), "v_cache": torch.ones(1, 3, 16, 8)},
         KernelBoundsError, "heads H=4 must be a positive multiple of k_cache's HKV=3"),
        ({"v_cache": torch.ones(1, 2, 15, 8)}, KernelBoundsError, "'v_cache' must have shape"),
        ({"k_cache": torch.ones(1, 2, 16, 8, dtype=torch.float64)}, KernelBoundsError,
         "'k_cache' must be torch.float32"),
        ({"v_cache": torch.ones(1, 2, 16, 8, dtype=torch.float16)}, KernelBoundsError,
         "'v_cache' must be torch.float32"),
        ({"start": torch.tensor(3)}, TypeError, "'start' must be a Python int"),
        ({"start": 3.0}, TypeError, "'start' must be a Python int"),
        ({"start": True}, TypeError, "'start' must be a Python int"),
        ({"start": -1}, KernelBoundsError, "'start' must satisfy 0 <= start.*got start=-1"),
        ({"start": 15}, KernelBoundsError, r"start \+ T <= S_max.*start=15, T=2, S_max=16"),
        ({"scale": "1"}, TypeError, "'scale' must be a number or None"),
        ({"scale": True}, TypeError, "'scale' must be a number or None"),
        ({"scale": float("nan")}, KernelBoundsError, "'scale' must be finite"),
        ({"out": torch.ones(1, 2, 4, 7)}, KernelBoundsError, "'out' must have shape"),
        ({"out": torch.ones(1, 2, 4, 8, dtype=torch.float64)}, KernelBoundsError,
         "'out' must be torch.float32"),
        ({"out": torch.ones(1, 2, 4, 8, device="meta")}, KernelBoundsError,
         "'out' is on meta"),
        ({"v_cache": torch.ones(1, 2, 16, 8, device="meta")}, KernelBoundsError,
         "'v_cache' is on meta"),
        ({"backend": "cuda"}, KernelBoundsError, "'backend' must be"),
    ]


def _call(args: dict[str, object]) -> torch.Tensor:
    return prefill_attention(
        args["q"], args["k_cache"], args["v_cache"], args["start"],  # type: ignore[arg-type]  # bad values on purpose
        scale=args.get("scale"), out=args.get("out"),  # type: ignore[arg-type]  # as above
        backend=args.get("backend", "reference"),  # type: ignore[arg-type]  # as above
    )


@pytest.mark.parametrize(("kwargs", "exc", "match"), _bad_args())
def test_bad_arguments_are_named(kwargs: dict[str, object], exc: type, match: str) -> None:
    args: dict[str, object] = {
        "q": torch.ones(1, 2, 4, 8), "k_cache": torch.ones(1, 2, 16, 8),
        "v_cache": torch.ones(1, 2, 16, 8), "start": 3,
    }
    args.update(kwargs)
    with pytest.raises(exc, match=match):
        _call(args)


def test_out_sharing_memory_is_refused() -> None:
    q, k, v = torch.ones(1, 2, 4, 8), torch.ones(1, 2, 16, 8), torch.ones(1, 2, 16, 8)
    with pytest.raises(KernelBoundsError, match="'out' must not share memory with 'q'"):
        prefill_attention(q, k, v, 0, out=q, backend="reference")
    with pytest.raises(KernelBoundsError, match="'out' must not share memory with 'v_cache'"):
        prefill_attention(q, k, v, 0, out=v[:, :, :4],
                          backend="reference")


@needs_interpreter
@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"q": torch.ones(1, 2, 4, 8, dtype=torch.float64),
          "k_cache": torch.ones(1, 2, 16, 8, dtype=torch.float64),
          "v_cache": torch.ones(1, 2, 16, 8, dtype=torch.float64)},
         "'q' dtype must be float16, bfloat16 or float32 for Triton"),
        ({"q": torch.ones(1, 2, 4, 300), "k_cache": torch.ones(1, 2, 16, 300),
          "v_cache": torch.ones(1, 2, 16, 300)}, "head dim D must be <= 256 for Triton"),
        ({"k_cache": torch.ones(1, 2, 8, 16).transpose(2, 3)},
         "'k_cache' must be contiguous along D"),
        ({"q": torch.ones(1, 2, 8, 4).transpose(2, 3)}, "'q' must be contiguous along D"),
    ],
)
def test_triton_only_limits(kwargs: dict[str, object], match: str) -> None:
    args: dict[str, object] = {
        "q": torch.ones(1, 2, 4, 8), "k_cache": torch.ones(1, 2, 16, 8),
        "v_cache": torch.ones(1, 2, 16, 8), "start": 0, "backend": "triton",
    }
    args.update(kwargs)
    with pytest.raises(KernelBoundsError, match=match):
        _call(args)
