"""Tree verify against transformers: decode small random HF Qwen3.5 checkpoints with dflash's
speculative tree steps and compare, token for token, with transformers' own greedy decoding.

The checkpoints are the chain parity test's (:mod:`test_parity_transformers`). The drafter
knows HF's greedy continuation and hides it among wrong siblings at random ranks
(:class:`SyntheticTreeDrafter`), so every tree branches and the accepted path often runs
through a later sibling: the verify's logits for nodes off the first chain (their positions,
their ancestor-only attention and their recurrent states along the path) decide the tokens.
Besides the tokens, every node's verify logits are compared with HF's forward over the
committed context and that node's path (within the chain test's tolerance), so an error
that leaves the argmax alone still shows. Every rollback mode that serves trees, float32 on
CPU (the chain test's dtype).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from dflash.execution import (
    RollbackMode,
    RollbackPolicy,
    RollbackStatus,
    ShardedTarget,
    SpecDecoder,
    plan_shards,
)
from dflash.model import TargetModel
from dflash.model.drafters.errors import OracleMismatchError
from dflash.model.drafters.trees import DraftTree, SyntheticTreeDrafter, tree_path

pytest.importorskip("transformers")

from test_parity_transformers import CASES, PROMPT, TOL, _hf_greedy, _hf_model  # needs transformers

N = 32  # tokens decoded: the prefill's one and 31 from tree steps (HF's greedy has 32)
BLOCK = 6  # a tree is at most BLOCK - 1 deep
RANKS = (0.45, 0.25, 0.15)  # HF's token at rank 0 / 1 / 2 of each depth's candidates
# the checkpoints under test, each with its layer split (one shard, and two)
SPLITS = {"qwen3_5_gqa_interval": "4", "qwen3_5_mqa_layout_tied": "2,3"}


class _Recording(SyntheticTreeDrafter):
    """The synthetic tree drafter, keeping every tree it proposed."""

    def __init__(self, oracle: list[int], vocab_size: int, seed: int) -> None:
        super().__init__(oracle, RANKS, vocab_size, seed)
        self.trees: list[DraftTree] = []

    def draft_tree(
        self, context: list[int], last: int, budget: int, depth_count: int
    ) -> DraftTree:
        tree = super().draft_tree(context, last, budget, depth_count)
        self.trees.append(tree)
        return tree


@pytest.fixture(scope="module", autouse=True)
def _one_thread() -> Iterator[None]:
    """These models' matrices are far too small to share between threads: one thread is
    faster, and immune to other load on the machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module", params=sorted(SPLITS))
def checkpoint(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, Any, TargetModel, list[int]]]:
    """``(case, the HF model, dflash's load of its checkpoint, HF's greedy tokens after
    PROMPT)``."""
    case = request.param
    kind, fields = CASES[case]
    hf = _hf_model(kind, fields, seed=len(case))
    path: Path = tmp_path_factory.mktemp(case)
    hf.save_pretrained(path)
    _, hf_tokens = _hf_greedy(hf)
    yield case, hf, TargetModel.from_pretrained(path), hf_tokens


def _path_slots(tree: DraftTree, tokens: tuple[int, ...]) -> list[int]:
    """The slots of the tree's path whose tokens are ``tokens`` (root first)."""
    children = tree.geometry().children
    path = [0]
    for token in tokens[1:]:  # siblings hold distinct tokens: one child matches
        path.append(next(c for c in children[path[-1]] if tree.tokens[c] == token))
    return path


def _off_first_chain(tree: DraftTree, path: list[int]) -> bool:
    """The path takes a later sibling somewhere: a child that is not its parent's first."""
    children = tree.geometry().children
    return any(children[p][0] != s for p, s in itertools.pairwise(path))


def _record_verifies(target: ShardedTarget) -> list[tuple[int, torch.Tensor]]:
    """Wrap ``target.forward``: every verify's start position and logits ``[T, vocab]``."""
    verifies: list[tuple[int, torch.Tensor]] = []
    forward = target.forward

    def recording(ids: Any, mode: Any, start: int, **kwargs: Any) -> tuple[torch.Tensor, Any]:
        logits, taps = forward(ids, mode, start, **kwargs)
        if mode == "verify":
            verifies.append((start, logits.detach().float().clone()))
        return logits, taps

    target.forward = recording  # type: ignore[method-assign]  # test double
    return verifies


@torch.inference_mode()
def _worst_node(
    hf: Any, context: list[int], verifies: list[tuple[int, torch.Tensor]], trees: list[DraftTree]
) -> tuple[float, str]:
    """The largest max-abs difference between a verify node's logits and HF's logits after
    ``context[:start]`` + that node's path, and where it is. One HF forward per leaf covers
    every node on the leaf's path."""
    worst, where = 0.0, "no node"
    for step, ((start, logits), tree) in enumerate(zip(verifies, trees, strict=True)):
        children = tree.geometry().children
        for leaf in (s for s in range(len(tree)) if not children[s]):
            path = tree_path(tree, leaf)
            ids = context[:start] + [tree.tokens[s] for s in path]
            theirs = hf(input_ids=torch.tensor([ids]), use_cache=False).logits[0, start:]
            diff = (logits[path] - theirs).abs().amax(-1)  # [len(path)]
            i = int(diff.argmax())
            if float(diff[i]) > worst:
                worst, where = float(diff[i]), f"step {step}, slot {path[i]} of {len(tree)}"
    return worst, where


@pytest.mark.parametrize("mode", ["checkpoint", "remap", "replay", "recompute"])
@pytest.mark.parametrize("budget", [4, 12])
def test_tree_steps_match_transformers(
    checkpoint: tuple[str, Any, TargetModel, list[int]], budget: int, mode: RollbackMode
) -> None:
    case, hf, model, hf_tokens = checkpoint
    drafter = _Recording(PROMPT + hf_tokens, model.config.vocab_size, seed=len(case))
    split = SPLITS[case]
    devices = ",".join(["cpu"] * (split.count(",") + 1))
    plan = plan_shards(model.config.num_hidden_layers, devices, split)
    target = ShardedTarget(model, plan, max_len=len(PROMPT) + N + 16, max_draft=12)
    verifies = _record_verifies(target)
    engine = SpecDecoder(
        target, drafter, block_size=BLOCK, policy=RollbackPolicy(mode=mode), tree_budget=budget
    )
    out = [engine.prefill(PROMPT)]
    while len(out) < N:
        try:
            out.extend(engine.step())
        except OracleMismatchError:  # a wrong token was emitted: the comparisons show it
            break
    worst, where = _worst_node(hf, PROMPT + out, verifies, drafter.trees)
    print(f"{case} budget={budget} {mode}: max |Δlogits| {worst:.2e} ({where}); accepted "
          f"{[r.accept_n for r in engine.records]}")
    assert worst <= TOL, f"verify logits differ from transformers' by {worst} at {where}"
    assert out[:N] == hf_tokens[:N]

    records = engine.records
    assert len(drafter.trees) == len(records) == len(verifies)  # one tree verified per step
    assert [r.nodes for r in records] == [len(tree) for tree in drafter.trees]
    # the trees branch: more nodes than their deepest path holds
    assert all(len(tree) > max(tree.geometry().depth) + 1 for tree in drafter.trees)
    assert any(r.accept_n > 2 for r in records)  # paths past the first draft token
    # some accepted paths run through a later sibling: a node off the tree's first chain
    paths = [_path_slots(tree, r.draft) for tree, r in zip(drafter.trees, records, strict=True)]
    assert [len(p) for p in paths] == [r.accept_n for r in records]
    assert any(_off_first_chain(tree, p) for tree, p in zip(drafter.trees, paths, strict=True))
    if mode != "replay":  # every tree after the capture gate's rolled back fast
        assert engine.status is RollbackStatus.EFFECTIVE
        assert engine.counts["fast"] == len(records) - 1
