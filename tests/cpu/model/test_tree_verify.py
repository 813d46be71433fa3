"""A tree verify in one forward: every node's row is what plain decoding of its path computes.

Node ``u`` of a validated draft tree sits at position ``committed + depth(u)``; its
attention sees the committed keys and its ancestors, its conv window and recurrent state
follow its ancestors. With M-invariant kernels its logits and its checkpointed state are
then bit for bit those of one-token decoding of the path root … ``u`` — on the torch
references and on the Triton kernels (interpreter).
"""

from __future__ import annotations

import pytest
import torch

from dflash.geometry import require_chain, require_tree
from dflash.kernels.checks import INTERPRET
from dflash.model import CacheError, ShardCaches, TargetModel
from dflash.model.caches import CaptureKind
from dflash.model.tiles import TILE_ROWS, PositionTiles

torch.set_num_threads(1)  # tiny matrices: one thread is faster and immune to machine load

PROMPT = [5, 17, 200, 3, 99, 42, 7, 11, 64, 9, 123]  # 11 tokens: the tree crosses a tile
#: a root with three children, a deep branch and siblings at several depths (T = 10)
PARENTS = (-1, 0, 0, 0, 1, 1, 4, 6, 2, 8)
TOKENS = [31, 250, 64, 9, 88, 123, 7, 42, 3, 77]


def _ids(tokens: list[int]) -> torch.Tensor:
    return torch.tensor([tokens])


def _path(u: int) -> list[int]:
    out = [u]
    while PARENTS[out[-1]] >= 0:
        out.append(PARENTS[out[-1]])
    return out[::-1]


def _prefilled(
    model: TargetModel, max_draft: int = 16, capture: CaptureKind = "states"
) -> ShardCaches:
    caches = model.new_caches(max_len=64, max_draft=max_draft, capture=capture, trees=True)
    model(_ids(PROMPT), caches, "prefill")
    return caches


def _plain(model: TargetModel, tokens: list[int]) -> tuple[torch.Tensor, ShardCaches]:
    """Plain one-token decoding of ``tokens`` after the prompt: the last logits, the caches."""
    caches = _prefilled(model, max_draft=1)
    logits = torch.empty(0)
    for tok in tokens:
        out, _ = model(_ids([tok]), caches, "decode")
        logits = out[0, -1]
    return logits, caches


def _check_tree(model: TargetModel) -> None:
    caches = _prefilled(model)
    pool = caches.pool
    pool.checkpoints.fill_(float("nan"))  # an unwritten slot cannot pass
    logits, _ = model(_ids(TOKENS), caches, "verify", geometry=require_tree(PARENTS))
    assert caches.kv.length == len(PROMPT) + len(TOKENS)
    for u in range(len(TOKENS)):
        path = _path(u)
        want, plain = _plain(model, [TOKENS[s] for s in path])
        assert torch.equal(logits[0, u], want), f"logits of node {u} (path {path})"
        for i, layer in enumerate(pool.layer_ids):
            state, _ = plain.pool.live_views(layer)
            assert torch.equal(pool.checkpoints[i, :, u], state), f"state of node {u} layer {i}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.inference_mode()
def test_every_node_is_plain_decoding_of_its_path(dtype: torch.dtype) -> None:
    model = TargetModel.tiny_default(seed=3).to(dtype)
    _check_tree(model)


@torch.inference_mode()
def test_a_chain_shaped_tree_is_the_chain_verify() -> None:
    model = TargetModel.tiny_default(seed=3)
    chain, tree = _prefilled(model), _prefilled(model)
    want, _ = model(_ids(TOKENS[:6]), chain, "verify", geometry=require_chain(range(-1, 5)))
    got, _ = model(_ids(TOKENS[:6]), tree, "verify", geometry=require_tree(range(-1, 5)))
    assert torch.equal(got, want)
    assert torch.equal(tree.pool.checkpoints[:, :, :6], chain.pool.checkpoints[:, :, :6])


@pytest.mark.skipif(not INTERPRET, reason="the Triton path on CPU needs TRITON_INTERPRET=1")
@torch.inference_mode()
def test_triton_path_every_node_is_plain_decoding_of_its_path() -> None:
    model = TargetModel.tiny_default(seed=3)
    model.kernel_backend = "triton"
    _check_tree(model)


@torch.inference_mode()
def test_tree_verify_refusals() -> None:
    model = TargetModel.tiny_default(seed=3)
    caches = model.new_caches(max_len=64, max_draft=16, capture="inputs")
    model(_ids(PROMPT), caches, "prefill")
    with pytest.raises(ValueError, match="needs its node-state scratch: build the caches with"):
        model(_ids(TOKENS), caches, "verify", geometry=require_tree(PARENTS))
    caches = model.new_caches(max_len=64, max_draft=16, batch=2)
    with pytest.raises(ValueError, match="a tree verify takes one sequence"):
        model(torch.tensor([TOKENS, TOKENS]), caches, "verify", geometry=require_tree(PARENTS))
    with pytest.raises(TypeError, match="needs a validated ChainGeometry or TreeGeometry"):
        model(_ids(TOKENS), _prefilled(model), "verify", geometry=PARENTS)


def test_position_tiles_place_siblings_in_separate_evaluations() -> None:
    """Rows sharing a position (siblings) never meet in one tile: each row is computed in
    row ``p mod TILE_ROWS`` of a tile holding only rows of other positions."""
    seen: list[torch.Tensor] = []

    def record(x: torch.Tensor) -> torch.Tensor:
        seen.append(x.clone())
        return x * 2

    start, offsets = 14, (0, 1, 1, 2, 2, 2, 3)  # positions 14, 15, 15, 16, 16, 16, 17
    x = torch.arange(1.0, 8.0).view(1, 7, 1)
    out = PositionTiles(start, offsets).apply(record, x)
    assert torch.equal(out, x * 2)
    for tile in seen:
        filled = tile[0, :, 0].nonzero().flatten().tolist()
        assert len(filled) == len(set(filled))
    placed = {
        (int(v), r) for tile in seen for r in range(TILE_ROWS) if (v := tile[0, r, 0]) != 0
    }
    for t, off in enumerate(offsets):
        assert (t + 1, (start + off) % TILE_ROWS) in placed
    assert len(seen) == 5  # tiles 0 and 1, with up to three copies at position 16


@pytest.mark.parametrize(
    ("mode", "backend"),
    [("checkpoint", "reference"), ("remap", "reference"), ("recompute", "reference"),
     pytest.param("recompute", "triton", marks=pytest.mark.skipif(
         not INTERPRET, reason="the Triton path on CPU needs TRITON_INTERPRET=1"))],
)
@torch.inference_mode()
def test_roll_back_to_an_accepted_branch_then_continue(mode: str, backend: str) -> None:
    """Verify the tree, roll back to one branch (state slot, or the recurrence recomputed
    along the path; conv window along the path; K/V rows compacted to consecutive
    positions), decode on: bit for bit plain decoding of the prompt, the branch and the new
    tokens."""
    model = TargetModel.tiny_default(seed=3)
    model.kernel_backend = backend  # type: ignore[assignment]  # one of the backends
    capture: CaptureKind = "inputs" if mode == "recompute" else "states"
    for u in (0, 3, 7, 9) if backend == "reference" else (3, 9):
        caches = _prefilled(model, capture=capture)
        model(_ids(TOKENS), caches, "verify", geometry=require_tree(PARENTS))
        path = _path(u)
        caches.pool.rollback_path(mode, path)
        caches.kv.compact(len(PROMPT), path)
        assert caches.length == len(PROMPT) + len(path)
        if mode == "remap":
            assert caches.pool.live_slot == u
        got = [model(_ids([tok]), caches, "decode")[0][0, -1] for tok in (200, 5)]
        tokens = [TOKENS[s] for s in path]
        want = [_plain(model, [*tokens, *extra])[0] for extra in ([200], [200, 5])]
        for g, w in zip(got, want, strict=True):
            assert torch.equal(g, w), f"node {u} path {path}"


@torch.inference_mode()
def test_a_path_outside_the_tree_is_refused_before_any_change() -> None:
    model = TargetModel.tiny_default(seed=3)
    caches = _prefilled(model)
    before = caches.pool.state.clone(), caches.pool.conv.clone()
    model(_ids(TOKENS), caches, "verify", geometry=require_tree(PARENTS))
    for bad in ([0, 4], [1, 4], [0, 1, 5, 6], [], [0, 11]):
        with pytest.raises(CacheError, match="path"):
            caches.pool.rollback_path("checkpoint", bad)
    with pytest.raises(CacheError, match="a 'recompute' rollback needs inputs capture"):
        caches.pool.rollback_path("recompute", [0])
    with pytest.raises(CacheError, match="'mode' must be one of checkpoint, remap, recompute"):
        caches.pool.rollback_path("replay", [0])
    assert torch.equal(caches.pool.state, before[0]) and torch.equal(caches.pool.conv, before[1])
    with pytest.raises(CacheError, match="must rise from slot 0"):
        caches.kv.compact(len(PROMPT), [0, 3, 2])
    caches.pool.restore_pre_verify()  # the way back still works: nothing was changed
    caches.kv.truncate(len(PROMPT))
    assert caches.length == len(PROMPT)
