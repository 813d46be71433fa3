"""Decode/verify attention: Triton (interpreter) against the reference, row invariance in
T on both backends (across block and split boundaries, GQA), unread cache rows,
NaN-poisoned outputs, a hand-checked example and argument checks; tree verification
(``paths``): every node's row bitwise equal to plain decoding of its path, and the
table's checks."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import triton
from kernels_support import NAN, needs_interpreter, rel_rms

from dflash.kernels import decode_attention, decode_attention_reference
from dflash.kernels.attention_triton import launch_decode_attention, split_count
from dflash.kernels.checks import Backend

TOL = {torch.float32: 1e-6, torch.bfloat16: 1e-2, torch.float16: 2e-3}
BACKENDS = [
    "reference",
    pytest.param("triton", marks=needs_interpreter),
]


def _qkv(B: int, T: int, H: int, HKV: int, D: int, S: int, dtype: torch.dtype,
         seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    q = (torch.randn(B, T, H, D, generator=gen) * 2).to(dtype)
    k = torch.randn(B, HKV, S, D, generator=gen).to(dtype)
    v = torch.randn(B, HKV, S, D, generator=gen).to(dtype)
    return q, k, v


def _poison_after(cache: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
    """A copy of ``cache`` whose rows past ``last[b]`` hold NaN (unwritten rows)."""
    out = cache.clone()
    for b, n in enumerate(last.tolist()):
        out[b, :, n + 1 :] = NAN
    return out


def _call(backend: Backend, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
          start: torch.Tensor, split: int | None, combine: int = 16,
          wide: tuple[int, int] = (16384, 2048)) -> torch.Tensor:
    """``split``: the Triton launch with ``split``-key splits (then ``wide[1]``-key ones
    from key ``wide[0]``), 16-key blocks and ``combine`` splits per combine tile."""
    out = torch.full_like(q, NAN)
    if split is None:
        return decode_attention(q, k, v, start, out=out, backend=backend)
    return launch_decode_attention(q, k, v, start, q.shape[-1] ** -0.5, out,
                                   split_keys=split, block_n=16, combine_splits=combine,
                                   wide_from=wide[0], wide_keys=wide[1])


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("H", "HKV", "D"), [(4, 2, 32), (2, 2, 64)])
def test_triton_matches_reference(H: int, HKV: int, D: int, dtype: torch.dtype) -> None:
    B, T, S = 2, 5, 70
    q, k, v = _qkv(B, T, H, HKV, D, S, dtype, seed=D + H)
    start = torch.tensor([0, 41])
    got = _call("triton", q, k, v, start, None)
    assert torch.isfinite(got).all()
    ref = decode_attention_reference(q.double(), k.double(), v.double(), start)
    assert rel_rms(got, ref) <= TOL[dtype]


@needs_interpreter
def test_triton_matches_reference_over_several_splits() -> None:
    """S_max = 300: three key splits of 128, rows on both sides of the boundaries."""
    B, T, H, HKV, D, S = 2, 9, 4, 2, 32, 300
    q, k, v = _qkv(B, T, H, HKV, D, S, torch.float32, seed=11)
    start = torch.tensor([122, 250])
    got = _call("triton", q, k, v, start, None)
    ref = decode_attention_reference(q.double(), k.double(), v.double(), start)
    assert rel_rms(got, ref) <= TOL[torch.float32]


def _check_rows_match_single_calls(
    backend: Backend, dtype: torch.dtype, H: int, HKV: int, D: int, S: int,
    start0: int, Ts: list[int], split: int | None, combine: int = 16,
    wide: tuple[int, int] = (16384, 2048),
) -> None:
    """Row t of a T-row call at ``start0`` equals the T=1 call at ``start0 + t`` bit for
    bit; the single call sees NaN in every cache row past its own position, the T-row
    call NaN past its last row (so no unwritten row can be read)."""
    T_max = max(Ts)
    q, k, v = _qkv(1, T_max, H, HKV, D, S, dtype, seed=start0 + H)
    start = torch.tensor([start0])
    alone = []
    for t in range(T_max):
        pos = start + t
        alone.append(_call(backend, q[:, t : t + 1], _poison_after(k, pos),
                           _poison_after(v, pos), pos, split, combine, wide)[:, 0])
    for T in Ts:
        last = start + T - 1
        got = _call(backend, q[:, :T], _poison_after(k, last), _poison_after(v, last),
                    start, split, combine, wide)
        for t in range(T):
            assert torch.equal(got[:, t], alone[t]), f"T={T} row {t}"


@pytest.mark.parametrize("backend", BACKENDS)
def test_rows_do_not_depend_on_T_gqa_across_splits(backend: Backend) -> None:
    """GQA (H=4, HKV=2), positions 120..136 across the 128-key split boundary and the
    64-key block boundaries of the default sizes."""
    _check_rows_match_single_calls(backend, torch.bfloat16, 4, 2, 32, 300, 120,
                                   [1, 8, 9, 17], None)


@pytest.mark.parametrize(
    ("backend", "dtype"),
    [("reference", torch.float32), ("reference", torch.float16),
     pytest.param("triton", torch.float32, marks=needs_interpreter)],
)
def test_rows_do_not_depend_on_T_from_start_zero(backend: Backend, dtype: torch.dtype) -> None:
    """H = HKV, start 0, every T = 1..17; the Triton path with 16-key blocks and splits,
    so rows cross block and split boundaries and share row tiles."""
    _check_rows_match_single_calls(backend, dtype, 1, 1, 16, 40, 0, list(range(1, 18)),
                                   None if backend == "reference" else 16)


@needs_interpreter
def test_rows_do_not_depend_on_T_small_splits_gqa() -> None:
    """float16, G = 4 query heads per KV head: 17 rows x 4 heads = 68 rows, five 16-row
    tiles; positions 13..29 across 32-key splits and 16-key blocks."""
    _check_rows_match_single_calls("triton", torch.float16, 8, 2, 32, 70, 13, [5, 17], 32)


@needs_interpreter
@pytest.mark.usefixtures("poisoned_workspace")
def test_rows_do_not_depend_on_T_across_combine_tiles() -> None:
    """16-key splits combined two at a time: positions 40..72 see 3 to 5 splits, so
    their combine walks two or three tiles, a partly masked one last; a 200-row cache
    (13 splits) whose splits past a row's position are never read."""
    _check_rows_match_single_calls("triton", torch.float32, 4, 2, 16, 200, 40, [1, 9, 33],
                                   16, combine=2)


@needs_interpreter
@pytest.mark.usefixtures("poisoned_workspace")
@pytest.mark.parametrize("start0", [58, 108])
def test_tree_rows_equal_plain_decoding_across_the_wide_splits(start0: int) -> None:
    """A branchy tree whose nodes sit at 58..63 + depth (across the switch to 48-key
    splits at key 64) or 108.. (across the first wide split's end at 112)."""
    _check_tree_rows_match_plain_decoding("triton", TREES["branchy"], torch.float32, 4, 2, 16,
                                          160, start0, 16, wide=(64, 48))


@needs_interpreter
@pytest.mark.usefixtures("poisoned_workspace")
def test_rows_do_not_depend_on_T_across_the_wide_splits() -> None:
    """16-key splits below key 64, 48-key splits from there (blocks of 16), combined two
    at a time: positions 50..90 cross the switch to wide splits and a wide split's end,
    in a 260-row cache whose later splits no row reads."""
    _check_rows_match_single_calls("triton", torch.float32, 4, 2, 16, 260, 50, [1, 7, 41],
                                   16, combine=2, wide=(64, 48))


@needs_interpreter
def test_wide_splits_match_reference() -> None:
    """Rows at positions 60..139 (narrow and wide splits, several combine tiles) within
    float32 tolerance of the float64 reference."""
    q, k, v = _qkv(1, 80, 4, 2, 32, 200, torch.float32, seed=8)
    start = torch.tensor([60])
    ref = decode_attention_reference(q.double(), k.double(), v.double(), start)
    got = _call("triton", q, k, v, start, 16, 2, (64, 48))
    assert rel_rms(got, ref) <= TOL[torch.float32]


@pytest.mark.parametrize(("S_max", "count"), [(1, 1), (128, 1), (129, 2), (16384, 128),
                                             (16385, 129), (18432, 129), (18433, 130),
                                             (262_208, 249)])
def test_split_count(S_max: int, count: int) -> None:
    assert split_count(S_max) == count


@needs_interpreter
def test_combine_over_many_tiles_matches_reference() -> None:
    """A row at position 190 combines 12 splits of 16 keys in 3 tiles of 4 (and the
    default single tile): both within float32 tolerance of the float64 reference."""
    q, k, v = _qkv(1, 2, 4, 2, 32, 256, torch.float32, seed=5)
    start = torch.tensor([189])
    ref = decode_attention_reference(q.double(), k.double(), v.double(), start)
    for combine in (4, 16):
        got = _call("triton", q, k, v, start, 16, combine)
        assert rel_rms(got, ref) <= TOL[torch.float32], f"combine {combine}"


@needs_interpreter
def test_combine_tile_must_be_a_power_of_two() -> None:
    q, k, v = _qkv(1, 1, 2, 2, 16, 32, torch.float32, seed=1)
    with pytest.raises(ValueError, match="'combine_splits' must be a power of two"):
        _call("triton", q, k, v, torch.tensor([3]), 16, 3)
    with pytest.raises(ValueError, match="'split_keys'=16 must divide 'wide_from'=40"):
        _call("triton", q, k, v, torch.tensor([3]), 16, 2, (40, 32))
    with pytest.raises(ValueError, match="'block_n'=16 must divide"):
        _call("triton", q, k, v, torch.tensor([3]), 16, 2, (64, 40))


@pytest.mark.parametrize("backend", BACKENDS)
def test_hand_checked_two_keys(backend: Backend) -> None:
    """scale 1, q = [1, 0], k0 = [0, 0], k1 = [ln 3, 0]: row 0 (position 0) sees k0 only
    -> v0; row 1 sees both with softmax weights [1/4, 3/4] -> v0/4 + 3 v1/4."""
    q = torch.tensor([[1.0, 0.0], [1.0, 0.0]]).view(1, 2, 1, 2)
    k = torch.tensor([[0.0, 0.0], [math.log(3.0), 0.0], [NAN, NAN]]).view(1, 1, 3, 2)
    v = torch.tensor([[4.0, 0.0], [0.0, 8.0], [NAN, NAN]]).view(1, 1, 3, 2)
    out = torch.full_like(q, NAN)
    got = decode_attention(q, k, v, torch.tensor([0]), scale=1.0, out=out,
                           backend=backend)
    expect = torch.tensor([[4.0, 0.0], [1.0, 6.0]]).view(1, 2, 1, 2)
    assert torch.allclose(got, expect, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_strided_cache_views(backend: Backend) -> None:
    """k/v given as views of a stacked [L, B, HKV, S, D] cache, out a view of a wider
    buffer: same values as contiguous copies."""
    q, k, v = _qkv(1, 3, 2, 1, 32, 40, torch.float32, seed=5)
    stack_k = torch.stack([k, k * 0 + NAN])
    stack_v = torch.stack([v, v * 0 + NAN])
    start = torch.tensor([20])
    buf = torch.full((1, 3, 2, 48), NAN)
    got = decode_attention(q, stack_k[0], stack_v[0], start, out=buf[..., :32],
                           backend=backend)
    ref = decode_attention_reference(q.double(), k.double(), v.double(), start)
    assert rel_rms(got, ref) <= 1e-6
    assert torch.isnan(buf[..., 32:]).all()


def _bad_args() -> list[tuple[dict[str, object], type, str]]:
    return [
        ({"q": [1.0]}, TypeError, "'q' must be a torch.Tensor"),
        ({"q": torch.ones(1, 2, 4)}, ValueError, "'q' must have 4 dimensions"),
        ({"q": torch.ones(1, 2, 4, 8, dtype=torch.int32)}, ValueError, "'q' must be a floating"),
        ({"q": torch.ones(1, 0, 4, 8)}, ValueError, "'q' must have B, T, H, D >= 1"),
        ({"k_cache": torch.ones(1, 2, 16, 4)}, ValueError, "'k_cache' must have shape"),
        ({"k_cache": torch.ones(1, 3, 16, 8), "v_cache": torch.ones(1, 3, 16, 8)},
         ValueError, "heads H=4 must be a positive multiple of k_cache's HKV=3"),
        ({"k_cache": torch.ones(1, 2, 1, 8), "v_cache": torch.ones(1, 2, 1, 8)},
         ValueError, "capacity S_max=1 must be >= T=2"),
        ({"v_cache": torch.ones(1, 2, 15, 8)}, ValueError, "'v_cache' must have shape"),
        ({"v_cache": torch.ones(1, 2, 16, 8, dtype=torch.float16)}, ValueError,
         "'v_cache' must be torch.float32"),
        ({"start": 3}, TypeError, "'start' must be a torch.Tensor"),
        ({"start": torch.tensor([1.0])}, ValueError, "'start' must be an int32/int64"),
        ({"start": torch.tensor([1, 2])}, ValueError, "'start' must be an int32/int64 tensor"),
        ({"start": torch.tensor([1], device="meta")}, ValueError, "'start' is on meta"),
        ({"scale": float("inf")}, ValueError, "'scale' must be a finite number"),
        ({"scale": True}, ValueError, "'scale' must be a finite number"),
        ({"out": torch.ones(1, 2, 4, 7)}, ValueError, "'out' must have shape"),
        ({"out": torch.ones(1, 2, 4, 8, dtype=torch.float64)}, ValueError, "'out' must be"),
        ({"backend": "cuda"}, ValueError, "'backend' must be"),
        # reference only: start is read on the host
        ({"start": torch.tensor([-1])}, ValueError, r"'start' must satisfy 0 <= start\[b\]"),
        ({"start": torch.tensor([15])}, ValueError, r"start\[b\] \+ T <= S_max = 16"),
    ]


@pytest.mark.parametrize(("kwargs", "exc", "match"), _bad_args())
def test_bad_arguments_are_named(kwargs: dict[str, object], exc: type, match: str) -> None:
    args: dict[str, object] = {
        "q": torch.ones(1, 2, 4, 8), "k_cache": torch.ones(1, 2, 16, 8),
        "v_cache": torch.ones(1, 2, 16, 8), "start": torch.tensor([3]), "scale": None,
        "out": None, "backend": "reference",
    }
    args.update(kwargs)
    with pytest.raises(exc, match=match):
        decode_attention(args["q"], args["k_cache"], args["v_cache"], args["start"],  # type: ignore[arg-type]  # bad values on purpose
                         scale=args["scale"], out=args["out"],  # type: ignore[arg-type]  # as above
                         backend=args["backend"])  # type: ignore[arg-type]  # as above


@needs_interpreter
@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"q": torch.ones(1, 2, 4, 8, dtype=torch.float64),
          "k_cache": torch.ones(1, 2, 16, 8, dtype=torch.float64),
          "v_cache": torch.ones(1, 2, 16, 8, dtype=torch.float64)},
         "'q' dtype must be float16, bfloat16 or float32"),
        ({"q": torch.ones(1, 2, 4, 300), "k_cache": torch.ones(1, 2, 16, 300),
          "v_cache": torch.ones(1, 2, 16, 300)}, "head dim D must be <= 256"),
        ({"k_cache": torch.ones(1, 2, 8, 16).transpose(2, 3)},
         "'k_cache' must be contiguous along D"),
    ],
)
def test_triton_only_limits(kwargs: dict[str, object], match: str) -> None:
    args: dict[str, object] = {
        "q": torch.ones(1, 2, 4, 8), "k_cache": torch.ones(1, 2, 16, 8),
        "v_cache": torch.ones(1, 2, 16, 8),
    }
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        decode_attention(args["q"], args["k_cache"], args["v_cache"], torch.tensor([0]),  # type: ignore[arg-type]  # bad values on purpose
                         backend="triton")


@needs_interpreter
def test_start_past_the_capacity_never_reads_past_the_cache() -> None:
    """The Triton path cannot check ``start`` without a host sync; with start + T past
    S_max it must still read no row at or past S_max. The cache is a view of a longer
    buffer whose rows past S_max hold NaN, so reading one would show."""
    q, k, v = _qkv(1, 2, 2, 2, 16, 40, torch.float32, seed=6)
    k[:, :, 20:] = NAN
    v[:, :, 20:] = NAN
    got = decode_attention(q, k[:, :, :20], v[:, :, :20], torch.tensor([19]),
                           backend="triton")
    assert torch.isfinite(got).all()


# --- tree verification: node t at start + depth(t) sees the committed keys and its path ---

#: parent of each slot (slot 0 the root): a chain, a star, a deep branch with siblings
TREES = {
    "chain": [-1, 0, 1, 2, 3, 4, 5],
    "star": [-1, 0, 0, 0, 0, 0, 0, 0, 0],
    "branchy": [-1, 0, 1, 2, 3, 1, 5, 0, 7, 2, 4, 10],
}


def _paths(parents: list[int]) -> torch.Tensor:
    """The int32 [T, T] root-to-node path table of ``parents``, -1 padded."""
    T = len(parents)
    table = torch.full((T, T), -1, dtype=torch.int32)
    for t in range(T):
        path = [t]
        while parents[path[-1]] >= 0:
            path.append(parents[path[-1]])
        table[t, : len(path)] = torch.tensor(path[::-1], dtype=torch.int32)
    return table


@pytest.fixture
def poisoned_workspace(monkeypatch: pytest.MonkeyPatch) -> None:
    """Floating tensors from ``torch.empty`` (the kernel's split workspace) start as NaN, so
    a combine that read a split its row's programs never wrote would show."""
    empty = torch.empty

    def poisoned(*args: object, **kwargs: object) -> torch.Tensor:
        t: torch.Tensor = empty(*args, **kwargs)  # type: ignore[call-overload]  # torch.empty's own arguments
        return t.fill_(NAN) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", poisoned)


def _path(paths: torch.Tensor, t: int) -> list[int]:
    return [int(s) for s in paths[t].tolist() if s >= 0]


def _tree_call(backend: Backend, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               start: torch.Tensor, paths: torch.Tensor | None,
               split: int | None, wide: tuple[int, int] = (16384, 2048)) -> torch.Tensor:
    out = torch.full_like(q, NAN)
    if split is None or backend == "reference":
        return decode_attention(q, k, v, start, out=out, paths=paths, backend=backend)
    return launch_decode_attention(q, k, v, start, q.shape[-1] ** -0.5, out,
                                   split_keys=split, block_n=16, paths=paths,
                                   combine_splits=2, wide_from=wide[0], wide_keys=wide[1])


def _check_tree_rows_match_plain_decoding(
    backend: Backend, parents: list[int], dtype: torch.dtype, H: int, HKV: int, D: int,
    S: int, start0: int, split: int | None, wide: tuple[int, int] = (16384, 2048),
) -> None:
    """The tree's K/V sit at cache rows start + slot (rows past start + T - 1 hold NaN);
    for every node t, plain decoding's cache holds the committed rows and the path's keys
    at rows start .. start + depth(t) (NaN past them): the tree call's row t equals the
    T = 1 chain call at start + depth(t) on that cache bit for bit."""
    paths = _paths(parents)
    T = len(parents)
    q, k, v = _qkv(1, T, H, HKV, D, S, dtype, seed=start0 + 7 * T + H)
    start = torch.tensor([start0])
    got = _tree_call(backend, q, _poison_after(k, start + T - 1),
                     _poison_after(v, start + T - 1), start, paths, split, wide)
    for t in range(T):
        rows = torch.tensor([start0 + s for s in _path(paths, t)])
        pos = start + len(rows) - 1
        plain_k, plain_v = k.clone(), v.clone()
        plain_k[:, :, start0 : int(pos) + 1] = k[:, :, rows]
        plain_v[:, :, start0 : int(pos) + 1] = v[:, :, rows]
        alone = _tree_call(backend, q[:, t : t + 1], _poison_after(plain_k, pos),
                           _poison_after(plain_v, pos), pos, None, split, wide)
        assert torch.equal(got[:, t], alone[:, 0]), f"node {t} (path {rows.tolist()})"


@pytest.mark.parametrize(
    ("tree", "H", "HKV", "D", "start0"),
    [
        # G = 3: nodes 5 and 10 straddle two 16-row tiles; positions 12..18 cross the
        # 16-key block boundary
        ("branchy", 6, 2, 16, 12),
        ("branchy", 8, 2, 32, 28),    # G = 4 (three 16-row tiles), across the 32-key split
        ("star", 2, 2, 16, 31),       # children at 32: the first key of the next split
        ("star", 2, 2, 16, 26),       # children at 27, their rows up to 34, past the split
        ("chain", 4, 1, 16, 0),       # G = 4, from an empty cache
    ],
)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.usefixtures("poisoned_workspace")
def test_tree_rows_equal_plain_decoding(backend: Backend, tree: str, H: int, HKV: int,
                                        D: int, start0: int) -> None:
    """Triton with 16-key blocks and 32-key splits (S_max = 70: three splits), float32,
    NaN in the split workspace until written."""
    _check_tree_rows_match_plain_decoding(backend, TREES[tree], torch.float32, H, HKV, D,
                                          70, start0, 32)


@pytest.mark.parametrize("backend", BACKENDS)
def test_tree_rows_equal_plain_decoding_bf16_default_sizes(backend: Backend) -> None:
    """bfloat16 at the default 64-key blocks and 128-key splits, positions 60..66 across a
    block boundary, S_max = 200 (two splits)."""
    _check_tree_rows_match_plain_decoding(backend, TREES["branchy"], torch.bfloat16, 4, 2,
                                          32, 200, 60, None)


@pytest.mark.parametrize("backend", BACKENDS)
def test_chain_paths_equal_the_chain_call(backend: Backend) -> None:
    """A chain's table (paths[t, d] = d for d <= t) gives the no-paths call bit for bit."""
    T, start0 = 10, 27
    q, k, v = _qkv(1, T, 4, 2, 16, 70, torch.float32, seed=3)
    start = torch.tensor([start0])
    k, v = _poison_after(k, start + T - 1), _poison_after(v, start + T - 1)
    chain = _tree_call(backend, q, k, v, start, None, 32)
    tree = _tree_call(backend, q, k, v, start, _paths([-1, *range(T - 1)]), 32)
    assert torch.isfinite(chain).all()
    assert torch.equal(tree, chain)


@pytest.mark.parametrize("backend", BACKENDS)
def test_tree_table_may_be_a_block_of_a_larger_buffer(backend: Backend) -> None:
    """The top-left [T, T] block of a wider table buffer (a static buffer a CUDA graph
    replays with) gives the contiguous table's result bit for bit."""
    paths = _paths(TREES["branchy"])
    T = paths.shape[0]
    buf = torch.full((T + 5, T + 5), 7, dtype=torch.int32)   # junk outside the block
    buf[:T, :T] = paths
    q, k, v = _qkv(1, T, 4, 2, 16, 70, torch.float32, seed=4)
    start = torch.tensor([20])
    want = _tree_call(backend, q, k, v, start, paths, 32)
    assert torch.equal(_tree_call(backend, q, k, v, start, buf[:T, :T], 32), want)


@needs_interpreter
@pytest.mark.parametrize("row_tiles", [2, 4])
@pytest.mark.parametrize(("tree", "start0"), [(None, 12), (None, 28), ("branchy", 12),
                                              ("branchy", 28), ("star", 31)])
@pytest.mark.usefixtures("poisoned_workspace")
def test_row_tiles_per_program_give_the_same_bits(tree: str | None, start0: int,
                                                  row_tiles: int) -> None:
    """A program holding 2 or 4 row tiles (each key block loaded once for them) gives the
    one-tile programs' output bit for bit: G = 3, so nodes straddle tiles; 12 nodes are
    36 rows, three tiles (the fourth of a 4-tile program is padding); chains and trees
    from 12 (one split) and across the 32-key split boundary; NaN past the draft's rows
    and in the workspace until written."""
    T = 12
    q, k, v = _qkv(1, T, 6, 2, 16, 70, torch.float32, seed=start0 + row_tiles)
    start = torch.tensor([start0])
    k, v = _poison_after(k, start + T - 1), _poison_after(v, start + T - 1)
    paths = None if tree is None else _paths(TREES[tree][:T] + [0] * (T - len(TREES[tree])))

    def call(tiles: int) -> torch.Tensor:
        out = torch.full_like(q, NAN)
        return launch_decode_attention(q, k, v, start, q.shape[-1] ** -0.5, out,
                                       split_keys=32, block_n=16, paths=paths,
                                       combine_splits=2, row_tiles=tiles)

    want = call(1)
    assert torch.isfinite(want).all()
    assert torch.equal(call(row_tiles), want)


@needs_interpreter
def test_row_tiles_are_one_two_or_four() -> None:
    q, k, v = _qkv(1, 2, 2, 2, 16, 8, torch.float32, seed=0)
    with pytest.raises(ValueError, match="'row_tiles' must be 1, 2 or 4 \\(got 3\\)"):
        launch_decode_attention(q, k, v, torch.tensor([0]), 0.25, None, row_tiles=3)


def test_row_tiles_for() -> None:
    """Every tile of a KV head's rows in one program, up to the cap: T = 1 is one tile, a
    16-row verify of a 4-head group (64 rows) four, a 64-node tree four per program; the
    default cap holds one tile per program until wider programs are timed on a GPU."""
    from dflash.kernels.attention_triton import row_tiles_for
    rows = (1, 4, 16, 17, 36, 64, 65, 256)
    assert [row_tiles_for(r, 4) for r in rows] == [1, 1, 1, 2, 4, 4, 4, 4]
    assert [row_tiles_for(r, 2) for r in rows] == [1, 1, 1, 2, 2, 2, 2, 2]
    assert [row_tiles_for(r, 1) for r in rows] == [1] * len(rows)


def test_row_tiles_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """One tile per program unless ``DFLASH_ATTENTION_ROW_TILES`` says 1, 2 or 4; any
    other value is refused by name."""
    from dflash.kernels.attention_triton import row_tiles_from_env
    monkeypatch.delenv("DFLASH_ATTENTION_ROW_TILES", raising=False)
    assert row_tiles_from_env(1) == 1
    for raw, want in (("", 1), ("1", 1), ("2", 2), ("4", 4)):
        monkeypatch.setenv("DFLASH_ATTENTION_ROW_TILES", raw)
        assert row_tiles_from_env(1) == want
    for raw in ("3", "8", "0", "four", " 2"):
        monkeypatch.setenv("DFLASH_ATTENTION_ROW_TILES", raw)
        with pytest.raises(ValueError, match=f"must be 1, 2 or 4 \\(got {raw!r}\\)"):
            row_tiles_from_env(1)


@needs_interpreter
def test_tree_triton_matches_the_float64_reference() -> None:
    """Values, not only invariance: the Triton tree call against the float64 reference."""
    parents = TREES["branchy"]
    T = len(parents)
    q, k, v = _qkv(1, T, 4, 2, 32, 70, torch.float32, seed=9)
    start = torch.tensor([30])
    paths = _paths(parents)
    got = _tree_call("triton", q, k, v, start, paths, 32)
    ref = decode_attention_reference(q.double(), k.double(), v.double(), start, paths=paths)
    assert rel_rms(got, ref) <= TOL[torch.float32]


def _bad_paths() -> list[tuple[dict[str, object], type, str]]:
    good = _paths([-1, 0])
    return [
        ({"paths": [[0, -1], [0, 1]]}, TypeError, "'paths' must be a torch.Tensor or None"),
        ({"paths": good.long()}, ValueError, r"'paths' must be an int32 tensor of shape \[T, T\]"),
        ({"paths": torch.full((2, 3), -1, dtype=torch.int32)}, ValueError,
         r"'paths' must be an int32 tensor of shape \[T, T\] = \(2, 2\)"),
        ({"paths": good.to("meta")}, ValueError, "'paths' is on meta"),
        ({"paths": good.t()}, ValueError, "'paths' must be contiguous along its last dimension"),
        ({"q": torch.ones(2, 2, 4, 8), "k_cache": torch.ones(2, 2, 16, 8),
          "v_cache": torch.ones(2, 2, 16, 8), "start": torch.tensor([3, 3]), "paths": good},
         ValueError, r"'paths' \(a tree verify\) needs B = 1: .*got B=2"),
    ]


def _malformed_paths() -> list[tuple[list[list[int]], str]]:
    return [
        ([[1, -1], [0, 1]], "row 0"),            # the root's path is [0]
        ([[0, 0], [0, 1]], "row 0"),             # padding must be -1
        ([[0, -1], [0, -1]], "row 1"),           # does not end at its own slot
        ([[0, -1], [-1, 1]], "row 1"),           # does not start at the root
        ([[0, -1], [0, -2]], "row 1"),           # bad padding value
    ]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("kwargs", "exc", "match"), _bad_paths())
def test_bad_paths_are_refused_before_writing(backend: Backend, kwargs: dict[str, object],
                                              exc: type, match: str) -> None:
    args: dict[str, object] = {
        "q": torch.ones(1, 2, 4, 8), "k_cache": torch.ones(1, 2, 16, 8),
        "v_cache": torch.ones(1, 2, 16, 8), "start": torch.tensor([3]),
    }
    args.update(kwargs)
    q = args["q"]
    assert isinstance(q, torch.Tensor)
    out = torch.full_like(q, NAN)
    with pytest.raises(exc, match=match):
        decode_attention(args["q"], args["k_cache"], args["v_cache"], args["start"],  # type: ignore[arg-type]  # bad values on purpose
                         out=out, paths=args["paths"], backend=backend)  # type: ignore[arg-type]  # as above
    assert torch.isnan(out).all()


@pytest.mark.parametrize(("table", "match"), [
    *_malformed_paths(),
    # three nodes: not strictly increasing; a prefix that is not the parent's row
    ([[0, -1, -1], [0, 1, -1], [0, 2, 2]], "row 2"),
    ([[0, -1, -1], [0, -1, -1], [0, 1, 2]], "row 1"),
    ([[0, -1, -1], [0, 1, -1], [0, -1, 2]], "row 2"),
    ([[0, -1, -1, -1], [0, 1, -1, -1], [0, 1, 2, -1], [0, 2, 3, -1]], "row 3"),
])
def test_reference_refuses_malformed_paths(table: list[list[int]], match: str) -> None:
    T = len(table)
    q = torch.ones(1, T, 2, 8)
    out = torch.full_like(q, NAN)
    paths = torch.tensor(table, dtype=torch.int32)
    with pytest.raises(ValueError, match=rf"'paths' {match} must be a root-to-node path"):
        decode_attention(q, torch.ones(1, 1, 16, 8), torch.ones(1, 1, 16, 8),
                         torch.tensor([3]), out=out, paths=paths, backend="reference")
    assert torch.isnan(out).all()


@needs_interpreter
def test_tree_triton_reads_no_row_outside_the_cache_whatever_paths_holds() -> None:
    """The Triton path cannot check the table's contents; slots far past the cache or
    negative must never be loaded. The cache is a view of a longer buffer whose rows
    past S_max hold NaN, so loading one would show."""
    q, k, v = _qkv(1, 3, 2, 2, 16, 40, torch.float32, seed=8)
    k[:, :, 20:] = NAN
    v[:, :, 20:] = NAN
    paths = torch.tensor([[0, -1, -1], [0, 1, -1], [0, 900, -7]], dtype=torch.int32)
    got = decode_attention(q, k[:, :, :20], v[:, :, :20], torch.tensor([17]), paths=paths,
                           backend="triton")
    assert torch.isfinite(got).all()


def test_the_gpu_key_loop_is_pipelined_for_sm90(tmp_path: Path) -> None:
    """The default program (a chain, one row tile, 4 warps), compiled for sm_90 at the 9B
    shape with the hints a launch gets: its key loop copies K and V to shared memory
    asynchronously (``LDGSTS``: the compiler software-pipelined it) and spills nothing. A
    key loop the compiler cannot pipeline (a static loop that takes a block only below a
    bound) compiles to plain loads, each block's latency exposed: 381 against 519 µs for a
    16-row verify at 131,072 keys on an H100 (BENCHMARKS.md). Compiled in a process
    without the interpreter (``benchmarks/sm90_resources.py``); no GPU needed."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not tool.exists():
        pytest.skip(f"this triton ships no {tool.name} to read an sm_90 binary with")
    root = Path(__file__).resolve().parents[3]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = tmp_path / "resources.json"
    subprocess.run(
        [sys.executable, str(root / "benchmarks" / "sm90_resources.py"),
         "--only", "attention chain row_tiles=1 warps=4", "--json", str(out)],
        cwd=root, env=env, check=True, capture_output=True, text=True, timeout=300,
    )
    (row,) = json.loads(out.read_text())["rows"]
    assert row["async_copies"] > 0, row
    assert row["stack_bytes"] == 0, row
