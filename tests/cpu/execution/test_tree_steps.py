"""Tree steps end to end on CPU: drafts of many branches, one verify, the accepted path's
rollback — the emitted tokens are plain greedy decoding's, in every rollback mode, under
faults at every phase, and a hostile tree never reaches a kernel."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from dflash.execution import (
    ExecutionError,
    FaultInjector,
    FaultPhase,
    RollbackMode,
    RollbackPolicy,
    RollbackStatus,
    ShardedTarget,
    SpecDecoder,
    plan_shards,
)
from dflash.model import TargetModel
from dflash.model.drafters import SyntheticDrafter
from dflash.model.drafters.trees import DraftTree, SyntheticTreeDrafter

PROMPT = "digits"
N = 24
BUDGET = 8
RANKS = (0.45, 0.25, 0.15)  # the target's token at rank 0 / 1 / 2 of each depth's candidates


def _engine(
    tiny: TargetModel, oracle: list[int], prompt: list[int], mode: RollbackMode, *,
    split: str = "3,3", faults: FaultInjector | None = None, drafter: object = None,
) -> SpecDecoder:
    devices = ",".join(["cpu"] * len(split.split(",")))
    target = ShardedTarget(tiny, plan_shards(6, devices, split), max_len=96, max_draft=BUDGET)
    tree = drafter or SyntheticTreeDrafter(prompt + oracle, RANKS, tiny.config.vocab_size, seed=4)
    return SpecDecoder(
        target, tree, block_size=6, policy=RollbackPolicy(mode=mode),  # type: ignore[arg-type]  # a tree drafter is a Drafter
        faults=faults, tree_budget=BUDGET,
    )


def _decode(engine: SpecDecoder, prompt: list[int], n: int) -> list[int]:
    out = [engine.prefill(prompt)]
    while len(out) < n:
        out.extend(engine.step())
    return out[:n]


@pytest.mark.parametrize("split", ["6", "3,3"])
@pytest.mark.parametrize("mode", ["replay", "checkpoint", "remap"])
def test_tree_steps_emit_plain_greedy(
    tiny: TargetModel, greedy: Callable[[str, int], list[int]], prompts: dict[str, list[int]],
    mode: RollbackMode, split: str,
) -> None:
    oracle = greedy(PROMPT, N + BUDGET)
    engine = _engine(tiny, oracle, prompts[PROMPT], mode, split=split)
    assert _decode(engine, prompts[PROMPT], N) == oracle[:N]
    trees = engine.records[1:]  # step 0 is the capture gate's chain step (fast modes)
    assert all(r.nodes > 1 for r in trees)
    assert any(r.nodes > r.accept_n and r.accept_n > 1 for r in trees)  # a branch accepted
    if mode != "replay":
        assert engine.status is RollbackStatus.EFFECTIVE
        assert engine.counts["fast"] == len(trees)


@pytest.mark.parametrize("mode", ["checkpoint", "remap"])
@pytest.mark.parametrize("phase", [p for p in FaultPhase if p is not FaultPhase.DURING_RECOVERY])
def test_tree_fault_at_every_phase_emits_only_greedy_tokens(
    tiny: TargetModel, greedy: Callable[[str, int], list[int]], prompts: dict[str, list[int]],
    mode: RollbackMode, phase: FaultPhase,
) -> None:
    oracle = greedy(PROMPT, N + BUDGET)
    faults = FaultInjector(phase=phase, steps=frozenset({1, 3}), shard=1)
    engine = _engine(tiny, oracle, prompts[PROMPT], mode, faults=faults)
    assert _decode(engine, prompts[PROMPT], N) == oracle[:N]
    assert [s for s, _ in faults.fired] == [1, 3]
    paths = [r.path for r in engine.records]
    assert paths[1] == paths[3] == "replay_after_failure"
    assert engine.counts["poison_events"] == (0 if phase is FaultPhase.BEFORE_RESTORE else 2)
    assert engine.status is RollbackStatus.EFFECTIVE  # recovered, fast again


class _Hostile(SyntheticTreeDrafter):
    """Returns a tree that breaks one rule (``how``) from its second tree on."""

    def __init__(self, how: str, *args: object) -> None:
        super().__init__(*args)  # type: ignore[arg-type]  # SyntheticTreeDrafter's own arguments
        self.how, self.calls = how, 0

    def draft_tree(self, context: list[int], last: int, budget: int, depth: int) -> DraftTree:
        tree = super().draft_tree(context, last, budget, depth)
        self.calls += 1
        if self.calls < 2:
            return tree
        if self.how == "root":
            return DraftTree((last + 1, *tree.tokens[1:]), tree.parents, tree.log_probs)
        if self.how == "vocab":
            return DraftTree((*tree.tokens[:-1], 10**6), tree.parents, tree.log_probs)
        if self.how == "budget":
            return super().draft_tree(context, last, budget + 4, depth)
        if self.how == "deep":
            n = budget
            return DraftTree((last,) * n, tuple(range(-1, n - 1)), (0.0,) * n)
        raise AssertionError(self.how)


@pytest.mark.parametrize(
    ("how", "message"),
    [("root", "rooted at"), ("vocab", "outside"), ("budget", "over tree_budget"),
     ("deep", "deep, over block_size")],
)
def test_a_hostile_tree_never_reaches_a_kernel(
    tiny: TargetModel, greedy: Callable[[str, int], list[int]], prompts: dict[str, list[int]],
    how: str, message: str,
) -> None:
    oracle = greedy(PROMPT, N + BUDGET)
    hostile = _Hostile(how, prompts[PROMPT] + oracle, RANKS, tiny.config.vocab_size, 4)
    engine = _engine(tiny, oracle, prompts[PROMPT], "checkpoint", drafter=hostile)
    out = [engine.prefill(prompts[PROMPT])]
    out.extend(engine.step())  # the gate's chain step
    out.extend(engine.step())  # the first tree
    forwards, committed = engine.target_forwards, engine.committed
    with pytest.raises(ExecutionError, match=message):
        engine.step()
    assert engine.target_forwards == forwards and engine.committed == committed
    assert out == oracle[: len(out)]


def test_tree_budget_refusals(
    tiny: TargetModel, greedy: Callable[[str, int], list[int]], prompts: dict[str, list[int]],
) -> None:
    oracle = greedy(PROMPT, N + BUDGET)
    target = ShardedTarget(tiny, plan_shards(6, "cpu"), max_len=96, max_draft=BUDGET)
    tree = SyntheticTreeDrafter(prompts[PROMPT] + oracle, RANKS, tiny.config.vocab_size)
    chain = SyntheticDrafter(prompts[PROMPT] + oracle, 0.5, tiny.config.vocab_size)
    cases: list[tuple[dict[str, object], str]] = [
        ({"drafter": chain, "tree_budget": 4}, "needs a drafter that proposes trees"),
        ({"drafter": tree, "tree_budget": 1}, "'tree_budget' must be None or an int >= 2"),
        ({"drafter": tree, "tree_budget": BUDGET + 1}, "exceeds the capture slots"),
        ({"drafter": tree, "tree_budget": 4, "policy": RollbackPolicy(mode="recompute")},
         "walks chains only"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            SpecDecoder(target, block_size=6, **kwargs)  # type: ignore[arg-type]  # refused on purpose
    engine = SpecDecoder(target, tree, block_size=6, tree_budget=4)
    with pytest.raises(ExecutionError, match="walks chains only"):
        engine.request_mode("recompute")
