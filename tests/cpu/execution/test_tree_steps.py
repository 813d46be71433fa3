"""Tree steps end to end on CPU: drafts of many branches, one verify, the accepted path's
rollback — the emitted tokens are plain greedy decoding's, in every rollback mode, under
faults at every phase, and a hostile tree never reaches a kernel."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest
import torch

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
from dflash.execution.capture_gate import ShardStorage
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
@pytest.mark.parametrize("mode", ["replay", "checkpoint", "remap", "recompute"])
def test_tree_steps_emit_plain_greedy(
    tiny: TargetModel, greedy: Callable[[str, int], list[int]], prompts: dict[str, list[int]],
    mode: RollbackMode, split: str,
) -> None:
    oracle = greedy(PROMPT, N + BUDGET)
    engine = _engine(tiny, oracle, prompts[PROMPT], mode, split=split)
    assert _decode(engine, prompts[PROMPT], N) == oracle[:N]
    trees = engine.records[1:]  # step 0 is the capture gate's (a tree, rolled back by replay)
    assert all(r.nodes > 1 for r in trees)
    assert any(r.nodes > r.accept_n and r.accept_n > 1 for r in trees)  # a branch accepted
    if mode != "replay":
        assert engine.status is RollbackStatus.EFFECTIVE
        assert engine.counts["fast"] == len(trees)
    if mode == "recompute":  # the inputs capture, with the node-state scratch, no states
        pool = engine.target.shards[0].caches.pool
        assert pool.capture == "inputs" and pool.tree_states is not None
        assert engine.gate.report.self_test is not None
        assert engine.gate.report.self_test.max_abs_err == 0.0


@pytest.mark.parametrize("mode", ["checkpoint", "remap", "recompute"])
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
    """Returns a tree that breaks one rule (``how``) from its third tree on."""

    def __init__(self, how: str, *args: object) -> None:
        super().__init__(*args)  # type: ignore[arg-type]  # SyntheticTreeDrafter's own arguments
        self.how, self.calls = how, 0

    def draft_tree(self, context: list[int], last: int, budget: int, depth: int) -> DraftTree:
        tree = super().draft_tree(context, last, budget, depth)
        self.calls += 1
        if self.calls < 3:
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
    out.extend(engine.step())  # the capture gate's step (a tree)
    out.extend(engine.step())  # the first fast tree
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
    ]
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            SpecDecoder(target, block_size=6, **kwargs)  # type: ignore[arg-type]  # refused on purpose


def test_requesting_recompute_between_tree_steps_rebuilds_for_trees(
    tiny: TargetModel, greedy: Callable[[str, int], list[int]], prompts: dict[str, list[int]],
) -> None:
    """A tree engine asked for ``recompute`` between steps gets inputs capture with the
    node-state scratch (the gate validates it afresh); the tokens stay plain greedy."""
    oracle = greedy(PROMPT, N + BUDGET)
    engine = _engine(tiny, oracle, prompts[PROMPT], "checkpoint")
    out = [engine.prefill(prompts[PROMPT])]
    for _ in range(3):
        out.extend(engine.step())
    assert engine.target.shards[0].caches.pool.capture == "states"
    engine.request_mode("recompute")
    pools = [s.caches.pool for s in engine.target.shards]
    assert all(p.capture == "inputs" and p.tree_states is not None for p in pools)
    while len(out) < N:
        out.extend(engine.step())
    assert out[:N] == oracle[:N]
    assert engine.gate.report.verdict == "validated" and engine.counts["fast"] > 0


@pytest.mark.parametrize("mode", ["checkpoint", "remap", "replay", "recompute"])
def test_trees_grown_from_a_dflash_drafter_are_plain_greedy(
    tiny: TargetModel, greedy: Callable[[str, int], list[int]], prompts: dict[str, list[int]],
    mode: RollbackMode,
) -> None:
    """A DFlash drafter's per-slot distributions grown best first: the drafter gets the
    accepted path's features, and the tokens are plain greedy decoding's."""
    from dflash.model.drafters import make_drafter

    oracle = greedy(PROMPT, N + BUDGET)
    drafter = make_drafter("dflash", tiny, seed=3)
    engine = _engine(tiny, oracle, prompts[PROMPT], mode, drafter=drafter)
    assert _decode(engine, prompts[PROMPT], N) == oracle[:N]
    assert all(r.nodes == BUDGET for r in engine.records[1:])


def test_dflash_candidates_are_the_proposal_distributions(tiny: TargetModel) -> None:
    """``candidates(k)``: per guess slot the ``k`` best tokens by log-softmax, best first,
    the first of them the proposal's own guess; before any proposal, a typed error."""
    import math

    from dflash.model.drafters import DraftArgumentError, make_drafter

    drafter = make_drafter("dflash", tiny, seed=3)
    with pytest.raises(DraftArgumentError, match="needs a host proposal first"):
        drafter.candidates(4)  # type: ignore[attr-defined]  # a DFlashDrafter
    features = torch.randn(5, len(drafter.tap_layers) * tiny.config.hidden_size)
    guesses = drafter.propose([1, 2, 3, 4, 5], 6, 5, features)
    cands = drafter.candidates(4)  # type: ignore[attr-defined]  # a DFlashDrafter
    assert len(cands) == 4 and all(len(level) == 4 for level in cands)
    for guess, level in zip(guesses, cands, strict=True):
        assert level[0][0] == guess
        lps = [lp for _, lp in level]
        assert lps == sorted(lps, reverse=True) and all(lp <= 0 for lp in lps)
        assert len({t for t, _ in level}) == 4
    probs = drafter.confidence()  # type: ignore[attr-defined]  # a DFlashDrafter
    assert probs is not None
    for p, level in zip(probs, cands, strict=True):  # confidence: float32 softmax
        assert math.isclose(math.exp(level[0][1]), p, rel_tol=1e-6)
    with pytest.raises(DraftArgumentError, match="'k' must be an int"):
        drafter.candidates(0)  # type: ignore[attr-defined]  # a DFlashDrafter


def test_the_dflash_drafter_sees_the_accepted_paths_features() -> None:
    """After tree steps the drafter's cache holds the features of the committed tokens (the
    verify's rows along each accepted path): its next proposal equals the one computed from
    a plain forward's features of the whole committed context (the trained default pair,
    so that paths longer than the root are accepted)."""
    from dflash.data import missing_files, require_default
    from dflash.model.drafters import make_drafter, stack_tap_features

    if missing_files("target") or missing_files("drafter"):
        pytest.skip("the embedded default pair is not installed")
    model = TargetModel.from_pretrained(require_default("target"))
    drafter = make_drafter(str(require_default("drafter")), model)
    plan = plan_shards(model.config.num_hidden_layers, "cpu")
    target = ShardedTarget(model, plan, max_len=160, max_draft=16)
    engine = SpecDecoder(target, drafter, block_size=16, tree_budget=12)
    prompt = list(b"def read_lines(path):\n    with open(path) as f:\n")
    _decode(engine, prompt, 48)
    assert any(r.accept_n > 2 for r in engine.records[1:])  # paths past the root
    cached, _ = engine.drafts.take(list(engine.context), engine.last)
    caches = model.new_caches(max_len=160, max_draft=1)
    with torch.inference_mode():
        _, taps = model(torch.tensor([engine.context]), caches, "prefill", taps=drafter.tap_layers)
    features = stack_tap_features(taps, drafter.tap_layers)
    fresh = make_drafter(str(require_default("drafter")), model)
    assert cached == fresh.propose_uncached(features, engine.last, 16)  # type: ignore[attr-defined]  # a DFlashDrafter


def test_the_capture_gate_validates_tree_capture_before_trees_roll_back_fast(
    tiny: TargetModel, greedy: Callable[[str, int], list[int]], prompts: dict[str, list[int]],
) -> None:
    """The gate's step is a tree: every node's slot judged, the accepted node's slot and
    the conv window along its path compared with the replay (bitwise here), and only then
    trees roll back fast."""
    oracle = greedy(PROMPT, N + BUDGET)
    engine = _engine(tiny, oracle, prompts[PROMPT], "checkpoint")
    assert _decode(engine, prompts[PROMPT], N) == oracle[:N]
    report = engine.gate.report
    assert report.verdict == "validated" and report.self_test is not None
    assert report.self_test.max_abs_err == 0.0
    assert all(e.slots_expected == engine.records[0].nodes for e in report.shards)
    assert engine.records[0].path == "replay" and engine.records[0].nodes > 1
    assert all(r.path == "fast" for r in engine.records[1:])


@pytest.mark.parametrize(
    ("tamper", "mode"),
    [("unwritten node", "checkpoint"), ("chain window", "checkpoint"),
     ("unwritten node", "recompute"), ("parent's path", "recompute")],
)
def test_the_tree_gate_refuses_bad_tree_capture(
    tiny: TargetModel, greedy: Callable[[str, int], list[int]], prompts: dict[str, list[int]],
    tamper: str, mode: RollbackMode,
) -> None:
    """A node slot (or a node's captured inputs) the verify left unwritten, a self-test
    that takes the conv window of the chain instead of the node's path, or one that
    recomputes along the parent's path: refused, every step replays, tokens unchanged."""
    from dflash.execution import CaptureGate

    oracle = greedy(PROMPT, N + BUDGET)
    engine = _engine(tiny, oracle, prompts[PROMPT], mode)
    if tamper == "unwritten node":
        after = engine.gate.after_shard
        buffer = "checkpoints" if mode == "checkpoint" else "inputs"

        def unwrite(k: int, shards: Sequence[ShardStorage]) -> None:
            if k == 0:
                getattr(shards[0].pool, buffer)[0, :, 3].fill_(float("nan"))
            after(k, shards)

        engine.gate.after_shard = unwrite  # type: ignore[method-assign]  # test double
    elif tamper == "parent's path":
        original = CaptureGate.save_slot

        def parents_path(
            shards: Sequence[ShardStorage], slot: int, path: Sequence[int] | None = None
        ) -> list[tuple[torch.Tensor, torch.Tensor]]:
            assert path is not None and len(path) > 1  # the gate's tree accepted a branch
            return original(shards, path[-2], path[:-1])  # one node short of the accepted

        engine.gate.save_slot = parents_path  # type: ignore[method-assign]  # test double
    else:
        original = CaptureGate.save_slot

        def chain_window(
            shards: Sequence[ShardStorage], slot: int, path: Sequence[int] | None = None
        ) -> list[tuple[torch.Tensor, torch.Tensor]]:
            return original(shards, slot)  # the window of slots 0 … slot, not the path's

        engine.gate.save_slot = chain_window  # type: ignore[method-assign]  # test double
    assert _decode(engine, prompts[PROMPT], N) == oracle[:N]
    assert engine.gate.report.verdict == "refused"
    assert engine.counts["fast"] == 0 and engine.status is RollbackStatus.REQUESTED


def test_lookup_assisted_trees_hold_the_copy_as_a_branch(
    tiny: TargetModel, greedy: Callable[[str, int], list[int]], prompts: dict[str, list[int]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``dflash+lookup``: the DFlash drafter's candidates grown best first, with prompt
    lookup's copy from the context held whole as one branch; plain greedy tokens."""
    import dflash.execution.engine as engine_module
    from dflash.model.drafters import make_drafter
    from dflash.model.drafters.trees import Candidates, best_first_tree

    branches: list[tuple[list[int], tuple[int, ...]]] = []

    def recording(
        root: int, candidates: Candidates, budget: int, *, branch: Sequence[int] | None = None
    ) -> DraftTree:
        tree = best_first_tree(root, candidates, budget, branch=branch)
        if branch is not None:
            branches.append((list(branch), tree.tokens))
        return tree

    monkeypatch.setattr(engine_module, "best_first_tree", recording)
    oracle = greedy("repeat", N + BUDGET)
    drafter = make_drafter("dflash+lookup", tiny, seed=3)
    engine = _engine(tiny, oracle, prompts["repeat"], "checkpoint", drafter=drafter)
    assert _decode(engine, prompts["repeat"], N) == oracle[:N]
    assert branches  # the repetitive prompt gives copies
    for branch, tokens in branches:  # the kept part of the copy: slots 1, 2, … from the root
        kept = branch[: BUDGET // 2]
        assert list(tokens[1 : 1 + len(kept)]) == kept


@pytest.mark.parametrize("mode", ["checkpoint", "remap", "recompute"])
def test_a_device_tree_acceptance_the_host_disagrees_with_is_undone(
    tiny: TargetModel, greedy: Callable[[str, int], list[int]], prompts: dict[str, list[int]],
    mode: RollbackMode, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The device finds the accepted node and enqueues its rollback before the step's one
    read; when the host's own reading of the read-back tokens (``accept_tree``) names
    another node, the step raises before anything is committed and the enqueued rollback
    is undone on every shard: pre-verify position, live state home and equal to the
    snapshot."""
    import dflash.execution.engine as engine_module

    oracle = greedy(PROMPT, N + BUDGET)
    engine = _engine(tiny, oracle, prompts[PROMPT], mode)
    engine.prefill(prompts[PROMPT])
    while engine.counts["fast"] < 2:
        engine.step()
    committed, context = engine.committed, list(engine.context)
    from dflash.model.tree_device import accept_tree_device as real

    def off_by_one(*args: object) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        best, count, path = real(*args)  # type: ignore[arg-type]  # the real signature
        return best, count + 1, path

    monkeypatch.setattr(engine_module, "accept_tree_device", off_by_one)
    with pytest.raises(ExecutionError, match=r"device tree acceptance .* disagrees"):
        engine.step()
    monkeypatch.undo()
    assert engine.committed == committed and engine.context == context
    for shard in engine.target.shards:
        pool = shard.caches.pool
        assert pool.position.tolist() == [committed] and pool.length == committed
        assert pool.live_slot is None and pool.live.tolist() == [-1]
        assert torch.equal(pool.state, pool.snapshot)
        assert pool.verify is not None and pool.verify.stage == "restored"
