"""The device twins of tree acceptance, the conv-window rows and the KV compaction
(:mod:`dflash.model.tree_device`) against their host references on random trees, with
the tables built as production builds them; and proof that they read nothing back to the
host and shape nothing by tensor values."""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest
import torch
from torch import Tensor

from dflash.geometry import require_tree
from dflash.model.caches import CacheError, KVCache, TreeTables, path_window_rows
from dflash.model.drafters.trees import DraftTree, accept_tree, tree_path
from dflash.model.tree_device import (
    accept_tree_device,
    compact_kv_device,
    conv_window_rows_device,
)

VOCAB = 3  # few tokens: siblings often share one and the target often matches
FAMILIES = ("random", "chain", "star", "bushy", "root")


def _parents(family: str, n: int, rng: random.Random) -> tuple[int, ...]:
    if family == "chain":
        return (-1, *range(n - 1))
    if family == "star":
        return (-1, *[0] * (n - 1))
    if family == "bushy":  # two or three children per node, a few levels deep
        return (-1, *(rng.randrange(max(0, (s - 1) // 2 - 1), (s - 1) // 2 + 1)
                      for s in range(1, n)))
    if family == "root":
        return (-1,)
    return (-1, *(rng.randrange(s) for s in range(1, n)))


def _tree(family: str, n: int, rng: random.Random) -> tuple[DraftTree, list[int]]:
    """A random tree of ``n`` slots and a target that follows one of a slot's children
    three times in four."""
    parents = _parents(family, n, rng)
    tokens = tuple(rng.randrange(VOCAB) for _ in parents)
    tree = DraftTree(tokens, parents, (0.0,) * len(parents))
    children: list[list[int]] = [[] for _ in parents]
    for s, p in enumerate(parents[1:], start=1):
        children[p].append(s)
    target = [
        tokens[rng.choice(kids)] if kids and rng.random() < 0.75 else rng.randrange(VOCAB)
        for kids in children
    ]
    return tree, target


def _tables(tree: DraftTree, S: int, rng: random.Random) -> TreeTables:
    """Production's tables for ``tree`` in ``S >= n`` slots; past the tree: stale depths and,
    every other time, garbage in the path table outside its ``[n, n]`` corner."""
    n = len(tree)
    tables = TreeTables(S, "cpu")
    tables.depth.random_(10_000, 20_000)
    tables.fill(require_tree(tree.parents))
    if rng.random() < 0.5:
        garbage = torch.randint(-5, 10_000, (S, S), dtype=torch.int32)
        garbage[:n, :n] = tables.paths[:n, :n]
        tables.paths.copy_(garbage)
    return tables


def _padded(values: list[int], size: int, rng: random.Random) -> Tensor:
    """``values`` followed by garbage tokens up to ``size`` entries."""
    tail = [rng.randrange(100, 1000) for _ in range(size - len(values))]
    return torch.tensor(values + tail, dtype=torch.int64)


def _cases(family: str, count: int, seed: int) -> Iterator[tuple[DraftTree, list[int], int]]:
    """``(tree, target, S)`` for ``count`` random trees of ``family``."""
    rng = random.Random(f"{family}-{seed}")
    for i in range(count):
        n = 1 if family == "root" else rng.choice((2, 3, 5, 8, 13, 24, 64 if i % 10 == 0 else 9))
        tree, target = _tree(family, n, rng)
        S = n + rng.choice((0, 0, 1, 7))
        yield tree, target, S


def _accept(tree: DraftTree, target: list[int], S: int, rng: random.Random) -> tuple[
    Tensor, Tensor, Tensor
]:
    n = len(tree)
    tables = _tables(tree, S, rng)
    tokens = _padded(list(tree.tokens), S, rng)
    return accept_tree_device(tokens, _padded(target, S, rng), tables.depth, tables.paths, n)


def _check_accept(tree: DraftTree, target: list[int], S: int, rng: random.Random) -> None:
    n = len(tree)
    best, count, path = _accept(tree, target, S, rng)
    ref_best, ref_path = accept_tree(tree, target)
    assert (best.shape, count.shape, path.shape) == ((1,), (1,), (n,))
    assert best.dtype == count.dtype == path.dtype == torch.int64
    got = (best.tolist(), count.tolist(), path.tolist())
    want = ([ref_best], [len(ref_path)], ref_path + [-1] * (n - len(ref_path)))
    assert got == want, f"parents={tree.parents} tokens={tree.tokens} target={target}"


@pytest.mark.parametrize("family", FAMILIES)
def test_accept_matches_host_reference(family: str) -> None:
    rng = random.Random(family)
    deepest = 0
    for tree, target, S in _cases(family, 150 if family != "root" else 20, seed=0):
        _check_accept(tree, target, S, rng)
        deepest = max(deepest, len(accept_tree(tree, target)[1]))
    # the cases accept past the root (and past the first level where there is one)
    assert deepest >= {"star": 2, "root": 1}.get(family, 3)


def test_accept_sibling_ties_keep_the_lowest_slot() -> None:
    rng = random.Random(1)
    # slots 1 and 2 share token 5 under the root; 4 (under 2) and 3 (under 1) both match
    tree = DraftTree((9, 5, 5, 6, 6), (-1, 0, 0, 1, 2), (0.0,) * 5)
    target = [5, 6, 6, 0, 0]
    assert accept_tree(tree, target)[0] == 3
    _check_accept(tree, target, 5, rng)
    # only the higher sibling's child matches: depth beats slot order
    tree = DraftTree((9, 5, 5, 6, 7), (-1, 0, 0, 1, 2), (0.0,) * 5)
    target = [5, 1, 7, 0, 0]
    assert accept_tree(tree, target)[0] == 4
    _check_accept(tree, target, 8, rng)
    # nothing matches: the root, whatever its own token and target
    tree = DraftTree((9, 5, 5), (-1, 0, 0), (0.0,) * 3)
    _check_accept(tree, [4, 4, 4], 3, rng)
    # a slot whose own token matches below a rejected parent is not accepted
    tree = DraftTree((9, 5, 6), (-1, 0, 1), (0.0,) * 3)
    assert accept_tree(tree, [4, 6, 0])[0] == 0
    _check_accept(tree, [4, 6, 0], 3, rng)


@pytest.mark.parametrize("kc1", [0, 1, 2, 3])
def test_conv_window_rows_match_host_reference(kc1: int) -> None:
    rng = random.Random(kc1)
    checked = 0
    for family in FAMILIES:
        for tree, target, S in _cases(family, 30, seed=1):
            n = len(tree)
            for u in range(n):  # every root-to-node path, padded with -1
                real = tree_path(tree, u)
                path = torch.tensor(real + [-1] * (n - len(real)), dtype=torch.int64)
                count = torch.tensor([len(real)], dtype=torch.int64)
                rows = conv_window_rows_device(path, count, kc1)
                assert rows.shape == (kc1,) and rows.dtype == torch.int64
                assert rows.tolist() == path_window_rows(real, kc1), (real, kc1)
                checked += 1
            _, count, path = _accept(tree, target, S, rng)  # straight from the acceptance
            real = accept_tree(tree, target)[1]
            assert conv_window_rows_device(path, count, kc1).tolist() == path_window_rows(
                real, kc1
            )
    assert checked > 1000


def _bits(t: Tensor) -> Tensor:
    return t.view(torch.int32)  # NaNs compare by their bits


@pytest.mark.parametrize("seed", range(4))
def test_compact_matches_kv_cache_compact(seed: int) -> None:
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    for family in FAMILIES:
        for tree, _, _ in _cases(family, 12, seed=seed):
            n = len(tree)
            real = tree_path(tree, rng.randrange(n))
            start = rng.randrange(0, 20)
            max_len = start + n + rng.choice((0, 1, 5))
            ref = KVCache((0, 3), max_len, batch=2, num_kv_heads=2, head_dim=3,
                          dtype=torch.float32, device="cpu")
            for cache in (ref.k, ref.v):
                cache.copy_(torch.randn(cache.shape, generator=gen))
                cache[:, :, :, start + n:] = float("nan")  # rows no verify wrote
            k, v = ref.k.clone(), ref.v.clone()
            before = (k.clone(), v.clone())
            ref.advance(0, start + n)
            ref.compact(start, real)

            path = torch.tensor(real + [-1] * (n - len(real)), dtype=torch.int64)
            compact_kv_device(k, v, torch.tensor([start]), path)
            for got, want, old in zip((k, v), (ref.k, ref.v), before, strict=True):
                assert torch.equal(_bits(got), _bits(want)), (real, start)
                outside = (slice(None),) * 3 + (slice(0, start),)
                assert torch.equal(_bits(got[outside]), _bits(old[outside]))
                after = (slice(None),) * 3 + (slice(start + n, None),)
                assert torch.equal(_bits(got[after]), _bits(old[after]))
                assert got[after].isnan().all()
                tail = (slice(None),) * 3 + (slice(start + len(real), start + n),)
                assert torch.equal(_bits(got[tail]), _bits(old[tail]))


def test_compact_per_layer_view_and_no_attention_layers() -> None:
    gen = torch.Generator().manual_seed(7)
    ref = KVCache((0,), 12, batch=1, num_kv_heads=2, head_dim=4, dtype=torch.float32,
                  device="cpu")
    ref.k.copy_(torch.randn(ref.k.shape, generator=gen))
    ref.v.copy_(torch.randn(ref.v.shape, generator=gen))
    k, v = (t[0].clone() for t in (ref.k, ref.v))  # [B, HKV, max_len, D]: positions at dim 2
    ref.advance(0, 9)
    ref.compact(3, [0, 2, 5])
    compact_kv_device(k, v, torch.tensor([3]), torch.tensor([0, 2, 5, -1, -1, -1]), dim=2)
    assert torch.equal(k, ref.k[0]) and torch.equal(v, ref.v[0])

    empty = KVCache((), 8, batch=1, num_kv_heads=2, head_dim=4, dtype=torch.float32,
                    device="cpu")
    compact_kv_device(empty.k, empty.v, torch.tensor([2]), torch.tensor([0, 3, -1, -1]))
    assert empty.k.shape == (0, 1, 2, 8, 4)


def _raise(*args: object, **kwargs: object) -> None:
    raise AssertionError("a host read of a tensor's value")


def _inputs(device: str) -> tuple[Tensor, ...]:
    """A 6-slot tree's tokens, target, depth and path table, a KV cache and a start, on
    ``device`` (built on the host: production fills the tables outside the graph)."""
    tree = DraftTree((1, 2, 2, 0, 1, 2), (-1, 0, 0, 1, 2, 3), (0.0,) * 6)
    tables = TreeTables(8, "cpu")
    tables.fill(tree.geometry())
    tokens = torch.tensor([*tree.tokens, 0, 0])
    target = torch.tensor([2, 0, 1, 2, 0, 0, 0, 0])
    k = torch.arange(2 * 16 * 2, dtype=torch.float32).view(2, 1, 1, 16, 2)
    cpu = (tokens, target, tables.depth, tables.paths, k, k + 0.5, torch.tensor([5]))
    return tuple(t.to(device) for t in cpu)


def _all_three(inputs: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
    """The three functions chained on :func:`_inputs`: ``(best, count, path, rows, k, v)``."""
    tokens, target, depth, paths, k, v, start = inputs
    best, count, path = accept_tree_device(tokens, target, depth, paths, 6)
    rows = conv_window_rows_device(path, count, 3)
    compact_kv_device(k, v, start, path)
    return best, count, path, rows, k, v


def test_no_host_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    """With every way of reading a tensor's value back on the host made to raise, the
    three functions still run and agree with the unpatched run."""
    want = [t.tolist() for t in _all_three(_inputs("cpu"))]
    inputs = _inputs("cpu")
    for name in ("item", "tolist", "numpy", "__bool__", "__int__", "__float__", "__index__"):
        monkeypatch.setattr(torch.Tensor, name, _raise)
    with pytest.raises(AssertionError, match="host read"):
        bool(torch.tensor(True))  # the patch is in force
    got = _all_three(inputs)
    monkeypatch.undo()
    assert [t.tolist() for t in got] == want
    assert want[:4] == [[5], [4], [0, 1, 3, 5, -1, -1], [4, 6, 8]]
    moved = [5 + s for s in (0, 1, 3, 5)] + list(range(9, 16))  # rows 5.. after the move
    assert want[4][0][0][0][:5] == [[2.0 * r, 2.0 * r + 1] for r in range(5)]
    assert want[4][0][0][0][5:] == [[2.0 * r, 2.0 * r + 1] for r in moved]


def test_shapes_do_not_depend_on_values() -> None:
    """On the meta device tensors have shapes and no values: a value-dependent shape or a
    host read would fail there."""
    best, count, path, rows, k, _ = _all_three(_inputs("meta"))
    assert (best.shape, count.shape, path.shape, rows.shape) == ((1,), (1,), (6,), (3,))
    assert rows.is_meta and k.shape == (2, 1, 1, 16, 2)
    assert conv_window_rows_device(path, count, 0).shape == (0,)


def test_bad_arguments_name_the_argument() -> None:
    ids = torch.zeros(4, dtype=torch.int64)
    paths = torch.full((4, 4), -1, dtype=torch.int32)
    with pytest.raises(ValueError, match="'n'"):
        accept_tree_device(ids, ids, ids, paths, 0)
    with pytest.raises(ValueError, match="'target'"):
        accept_tree_device(ids, ids[:2], ids, paths, 3)
    with pytest.raises(ValueError, match="'paths'"):
        accept_tree_device(ids, ids, ids, paths[:, :2], 3)
    with pytest.raises(ValueError, match="'depth' is on meta"):
        accept_tree_device(ids, ids, ids.to("meta"), paths, 3)
    with pytest.raises(ValueError, match="'kc1'"):
        conv_window_rows_device(ids, ids[:1], -1)
    with pytest.raises(ValueError, match="'count'"):
        conv_window_rows_device(ids, ids[:2], 2)
    kv = torch.zeros(1, 1, 1, 8, 2)
    with pytest.raises(ValueError, match="'k' and 'v'"):
        compact_kv_device(kv, kv[..., :1], ids[:1], ids)
    with pytest.raises(ValueError, match="'dim'"):
        compact_kv_device(kv, kv, ids[:1], ids, dim=5)
    with pytest.raises(ValueError, match="'start'"):
        compact_kv_device(kv, kv, ids, ids)


def test_tree_tables_refilled_with_trees_of_every_size_hold_each_trees_tables() -> None:
    """One :class:`TreeTables` refilled step after step with trees of other sizes (larger,
    then smaller, chains and bushes): each fill's ``[T, T]`` path corner, parents, reload
    flags, walks and depths equal the tree's own tables (``tree_paths``, ``tree_parents_into``),
    whatever an earlier, larger tree left in the buffers; the paths and parents share one
    buffer (one copy per fill)."""
    from dflash.kernels import tree_parents_into, tree_paths

    rng = random.Random(12)
    S = 24
    tables = TreeTables(S, "cpu")
    assert tables.paths.untyped_storage().data_ptr() == tables.parents.untyped_storage().data_ptr()
    for T in (24, 3, 17, 1, 24, 9, 2, 13):
        parents = [-1] + [rng.randrange(s) if rng.random() < 0.6 else s - 1 for s in range(1, T)]
        geometry = require_tree(tuple(parents))
        tables.fill(geometry)
        assert torch.equal(tables.paths[:T, :T], tree_paths(geometry, "cpu")), T
        want = torch.zeros(2 * T + T * T, dtype=torch.int32)
        tree_parents_into(geometry, want)
        assert torch.equal(tables.parents[: 2 * T + T * T], want), T
        assert tables.depth[:T].tolist() == list(geometry.depth), T
    with pytest.raises(CacheError, match="exceeds the 24 slots"):
        tables.fill(require_tree((-1, *range(S))))
