"""tree_paths / tree_paths_into: the root-to-node path table of a validated geometry."""

from __future__ import annotations

import random

import pytest
import torch

from dflash.errors import KernelBoundsError
from dflash.geometry import require_chain, require_tree, validate_tree
from dflash.kernels import tree_parents_into, tree_paths, tree_paths_into


def walked(parents: tuple[int, ...]) -> list[list[int]]:
    """The table by walking each node's parents up to the root (the oracle)."""
    T = len(parents)
    table = []
    for t in range(T):
        path = [t]
        while parents[path[-1]] != -1:
            path.append(parents[path[-1]])
        table.append(path[::-1] + [-1] * (T - len(path)))
    return table


def random_parents(T: int, seed: int) -> tuple[int, ...]:
    rng = random.Random(seed)
    return (-1, *(rng.randrange(s) for s in range(1, T)))


TREES = {
    "root only": (-1,),
    "chain": (-1, 0, 1, 2, 3),
    "star": (-1, 0, 0, 0, 0, 0),
    "deep with siblings": (-1, 0, 1, 2, 3, 4, 1, 6, 0, 8, 2),
    "random 300": random_parents(300, seed=3),
}


@pytest.mark.parametrize("name", TREES)
def test_tree_table_is_every_nodes_root_path(name: str) -> None:
    parents = TREES[name]
    geometry = require_tree(parents)
    paths = tree_paths(geometry, "cpu")
    assert paths.dtype == torch.int32 and paths.device == torch.device("cpu")
    assert paths.tolist() == walked(parents)
    T = len(parents)
    slot = torch.arange(T)
    depth = torch.tensor(geometry.depth)
    assert torch.equal(paths[:, 0], torch.zeros(T, dtype=torch.int32))
    assert torch.equal(paths[slot, depth], slot.to(torch.int32))


@pytest.mark.parametrize("T", [1, 2, 7])
def test_chain_table_is_d_up_to_t(T: int) -> None:
    chain = tuple(range(-1, T - 1))
    expected = [[d if d <= t else -1 for d in range(T)] for t in range(T)]
    assert tree_paths(require_chain(chain), torch.device("cpu")).tolist() == expected
    assert tree_paths(require_tree(chain), "cpu").tolist() == expected, "a tree that is a chain"


@pytest.mark.parametrize("name", ["chain", "deep with siblings"])
def test_into_fills_the_top_left_block_and_minus_one_elsewhere(name: str) -> None:
    geometry = require_tree(TREES[name])
    T, Tmax = geometry.n_actual, 16
    buf = torch.full((Tmax, Tmax), 7, dtype=torch.int32)  # stale contents
    assert tree_paths_into(geometry, buf) is buf
    assert torch.equal(buf[:T, :T], tree_paths(geometry, "cpu"))
    rest = torch.ones(Tmax, Tmax, dtype=torch.bool)
    rest[:T, :T] = False
    assert (buf[rest] == -1).all()
    exact = torch.zeros(T, T, dtype=torch.int32)
    tree_paths_into(geometry, exact)
    assert torch.equal(exact, tree_paths(geometry, "cpu")), "Tmax == T"


def test_only_validated_geometry_is_accepted() -> None:
    rejected = validate_tree([-1, 5])
    assert not rejected.accepted
    buf = torch.full((4, 4), 7, dtype=torch.int32)
    for bad, name in [([-1, 0, 0], "list"), ({"parents": [-1, 0]}, "dict"),
                      (rejected, "Rejection"), (None, "NoneType"), ((-1, 0), "tuple")]:
        with pytest.raises(TypeError,
                           match=rf"validated ChainGeometry or TreeGeometry .*got {name}"):
            tree_paths(bad, "cpu")  # type: ignore[arg-type]  # wrong types on purpose
        with pytest.raises(TypeError, match=f"got {name}"):
            tree_paths_into(bad, buf)  # type: ignore[arg-type]  # wrong types on purpose
    assert (buf == 7).all(), "a refused call writes nothing"


def test_bad_device_and_out_are_named() -> None:
    geometry = require_tree((-1, 0, 0, 1))
    with pytest.raises(TypeError, match=r"'device' must be a torch\.device or str .*got int"):
        tree_paths(geometry, 0)  # type: ignore[arg-type]  # wrong type on purpose
    with pytest.raises(KernelBoundsError, match=r"'device' names no device .*'gpu0'"):
        tree_paths(geometry, "gpu0")
    cases: list[tuple[object, type[Exception], str]] = [
        ([[0]], TypeError, "'out' must be a torch.Tensor .*got list"),
        (torch.full((4, 4), 7, dtype=torch.int64), KernelBoundsError, "'out' must be torch.int32"),
        (torch.full((4, 5), 7, dtype=torch.int32), KernelBoundsError, "square .*\\(4, 5\\)"),
        (torch.full((16,), 7, dtype=torch.int32), KernelBoundsError, "square .*\\(16,\\)"),
        (torch.full((3, 3), 7, dtype=torch.int32), KernelBoundsError,
         "Tmax=3 slots but the geometry has n_actual=4"),
    ]
    for out, error, match in cases:
        with pytest.raises(error, match=match):
            tree_paths_into(geometry, out)  # type: ignore[arg-type]  # bad values on purpose
        if isinstance(out, torch.Tensor):
            assert (out == 7).all(), "a refused call writes nothing"


@pytest.mark.parametrize("seed", range(6))
def test_tree_parents_into_is_the_parents_the_reloaded_nodes_and_the_walks(seed: int) -> None:
    """``out[:T]`` the parents; then the walks (rows of ``T`` from ``2T``): the trunk (the
    root, each node's lowest child) and every subtree off it in ascending slots, together
    every node exactly once, each walk's nodes after their parents; ``out[T:2T]`` 1
    exactly for the nodes some node starts from without following them in its walk; the
    rest untouched."""
    T = 3 + seed * 2
    parents = random_parents(T, seed)
    n = 2 * T + T * T
    out = torch.full((n + 3,), 77, dtype=torch.int32)
    assert tree_parents_into(require_tree(parents), out) is out
    assert out[:T].tolist() == list(parents)
    rows = out[2 * T : n].view(T, T).tolist()
    walks = [[s for s in row if s >= 0] for row in rows if row[0] >= 0]
    assert all(row[len(w):] == [-1] * (T - len(w)) for row, w in zip(rows, walks, strict=False))
    assert sorted(s for w in walks for s in w) == list(range(T))
    trunk = [0]
    while any(p == trunk[-1] for p in parents):
        trunk.append(min(c for c, p in enumerate(parents) if p == trunk[-1]))
    assert walks[0] == trunk
    for w in walks[1:]:
        assert parents[w[0]] in trunk and w == sorted(w)
        assert all(parents[s] in w[:i] for i, s in enumerate(w) if i > 0)
    reloaded = [0] * T
    for w in walks:
        for prev, s in zip([-1, *w], w, strict=False):
            if parents[s] >= 0 and parents[s] != prev:
                reloaded[parents[s]] = 1
    assert out[T : 2 * T].tolist() == reloaded
    assert out[n:].tolist() == [77] * 3


def test_tree_parents_into_refusals() -> None:
    tree = require_tree((-1, 0, 0, 1))
    with pytest.raises(TypeError, match="validated TreeGeometry"):
        tree_parents_into(require_chain([-1, 0, 1, 2]), torch.zeros(8, dtype=torch.int32))  # type: ignore[arg-type]  # a chain on purpose
    with pytest.raises(TypeError, match=r"'out' must be a torch\.Tensor"):
        tree_parents_into(tree, [0] * 8)  # type: ignore[arg-type]  # a list on purpose
    for bad in (torch.zeros(24, dtype=torch.int64), torch.zeros(2, 12, dtype=torch.int32),
                torch.zeros(23, dtype=torch.int32)):
        with pytest.raises(KernelBoundsError, match=r"at least 2\*T \+ T\*T=24 entries"):
            tree_parents_into(tree, bad)
