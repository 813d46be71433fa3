"""The graph path on CPU — slot remaps, the rollback and the DFlash drafter's step —
through a replay that behaves like a CUDA graph.

The stand-in of ``test_device_step.py`` re-runs the shard's Python on every replay, so it
recomputes every view and host value afresh. A CUDA graph does not: it replays the
recorded kernels against the addresses and scalars of the capture. :func:`recorded_capture`
does the same on CPU: it records every ATen operation (``TorchDispatchMode``) and every
Triton launch (the interpreter) of the captured work, and a replay re-issues exactly those
operations on the very tensors of the capture — inputs, views into the caches (the live
checkpoint slot), intermediates and outputs — with the scalars of the capture. A graph key
that did not pin everything its work baked in (the live slot above all) decodes wrong
tokens here, as it would on a GPU.

Runs the model's Triton kernels, so it needs ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from dflash.execution import RollbackMode, RollbackPolicy, ShardedTarget, SpecDecoder, plan_shards
from dflash.execution.graphs import ShardGraphs, ShardOutput
from dflash.kernels.checks import INTERPRET
from dflash.model import HybridConfig, TargetModel, greedy_generate
from dflash.model.drafters import (
    DFlashConfig,
    DFlashDrafter,
    LookupAssistedDrafter,
    SyntheticDrafter,
)

pytestmark = pytest.mark.skipif(
    not INTERPRET, reason="the model's Triton kernels on CPU need TRITON_INTERPRET=1"
)

Op = tuple[Any, ...]


class _Recorder(TorchDispatchMode):  # type: ignore[no-untyped-call]  # torch's hook is unannotated
    """Runs and records every ATen operation (not those inside a Triton launch)."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # torch's __init__ is unannotated
        self.ops: list[Op] = []
        self.inside_launch = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]  # torch's hook
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not self.inside_launch:
            self.ops.append(("aten", func, args, kwargs, out))
        return out


_RECORDING: list[_Recorder] = []


@pytest.fixture
def record_launches(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Record the Triton launches made while a capture records (interpreter only)."""
    import triton.runtime.interpreter as interpreter

    original = interpreter.InterpretedFunction.run

    def run(self: Any, *args: Any, grid: Any, warmup: Any, **kwargs: Any) -> Any:
        rec = _RECORDING[-1] if _RECORDING else None
        if rec is None or warmup:
            return original(self, *args, grid=grid, warmup=warmup, **kwargs)
        rec.inside_launch += 1
        try:
            result = original(self, *args, grid=grid, warmup=warmup, **kwargs)
        finally:
            rec.inside_launch -= 1
        rec.ops.append(("triton", lambda: original(self, *args, grid=grid, warmup=False,
                                                   **kwargs)))
        return result

    monkeypatch.setattr(interpreter.InterpretedFunction, "run", run)
    yield


def _reissue(op: Op) -> None:
    if op[0] == "triton":
        op[1]()
        return
    _, func, args, kwargs, out = op
    result = func(*args, **kwargs)
    if func._schema.is_mutable:  # in place / out=: it wrote the capture's tensors
        return
    inputs = {
        t.untyped_storage().data_ptr()
        for t in tree_flatten((args, kwargs))[0]
        if isinstance(t, torch.Tensor)
    }
    for mine, fresh in zip(tree_flatten(out)[0], tree_flatten(result)[0], strict=True):
        if isinstance(mine, torch.Tensor) and mine.untyped_storage().data_ptr() not in inputs:
            mine.copy_(fresh)  # a fresh result lands where the capture's result lives


def recorded_capture(
    work: Callable[[], ShardOutput],
) -> tuple[Callable[[], None], ShardOutput]:
    """Capture ``work`` the way a CUDA graph does (see the module docstring).

    The capture runs ``work`` once while recording (a CUDA capture records it and the
    first replay runs it), so the first replay does nothing; later ones re-issue the
    recorded operations.
    """
    rec = _Recorder()
    _RECORDING.append(rec)
    try:
        with rec:
            outputs = work()
    finally:
        _RECORDING.pop()
    first = [True]

    def replay() -> None:
        if first[0]:
            first[0] = False
            return
        for op in rec.ops:
            _reissue(op)

    return replay, outputs


PROMPT = [11, 12, 11, 12, 11, 12, 11, 12, 40]
BLOCK = 5


@pytest.fixture(scope="module")
def oracle() -> list[int]:
    return greedy_generate(TargetModel.tiny_default(seed=0), PROMPT, 48)


def _decode(
    oracle: list[int], mode: RollbackMode, n: int, graphs: type[ShardGraphs] = ShardGraphs
) -> tuple[list[int], list[int | None], list[ShardGraphs]]:
    model = TargetModel.seeded(HybridConfig.tiny_default(), seed=0)
    model.kernel_backend = "triton"
    target = ShardedTarget(model, plan_shards(6), max_len=len(PROMPT) + n + BLOCK + 1,
                           max_draft=BLOCK)
    target.graphs = [graphs(s.device, capture=recorded_capture) for s in target.shards]
    drafter = SyntheticDrafter(PROMPT + oracle, 0.8, model.config.vocab_size, seed=3)
    engine = SpecDecoder(target, drafter, block_size=BLOCK, policy=RollbackPolicy(mode=mode))
    out, slots = [engine.prefill(PROMPT)], []
    while len(out) < n:
        out.extend(engine.step())
        slots.append(target.shards[0].caches.pool.live_slot)
        if out != oracle[: len(out)]:
            break
    return out[:n], slots, target.graphs


@pytest.mark.usefixtures("record_launches")
def test_remap_through_recorded_graphs_is_plain_greedy(oracle: list[int]) -> None:
    """Commits of several lengths: one verify graph serves every live slot (the kernels read
    the slot on the device), the remap itself is a replayed graph on the device's count; the
    tokens are plain greedy's."""
    out, slots, graphs = _decode(oracle, "remap", 40)
    assert out == oracle[:40]
    assert len({s for s in slots if s is not None}) >= 3, slots  # several slots were live
    g = graphs[0]
    keys = g.captured_keys
    assert [k for k in keys if k[0] == "verify"] == [("verify", BLOCK, True)], keys
    assert ("rollback:remap", 1, False) in keys, keys
    assert g.replays >= 6 and not g.failures, (g.replays, g.failures)


@pytest.mark.usefixtures("record_launches")
def test_recorded_graphs_catch_a_forward_that_bakes_in_the_slot(
    oracle: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The recorded replay is faithful enough to fail a graph whose forward reads the live
    state at the address of the slot live at capture time (a host value baked in), once the
    live state moved to another slot."""
    from dflash.model.caches import RecurrentPool
    from dflash.model.drafters.errors import OracleMismatchError

    def host_slot_views(
        self: RecurrentPool, layer: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        state, conv = self.live_views(layer)  # the host's slot, as an address
        return state, conv, self.checkpoints[0], torch.full((1,), -1)

    monkeypatch.setattr(RecurrentPool, "kernel_views", host_slot_views)
    try:
        out, _, _ = _decode(oracle, "remap", 40)
    except OracleMismatchError:
        return
    assert out != oracle[:40]


def _dflash(model: TargetModel, **changes: object) -> DFlashDrafter:
    cfg = DFlashConfig.for_target(
        hidden_size=64, vocab_size=256, num_target_layers=6, num_hidden_layers=2,
        block_size=BLOCK,
    ).model_copy(update=changes)
    return DFlashDrafter.random(cfg, model.embed_tokens.weight, model.lm_head.weight, seed=2)


def _dflash_run(mode: RollbackMode, n: int, graphs: bool, tree_budget: int | None = None,
                lookup: bool = False, changes: dict[str, object] | None = None
                ) -> SpecDecoder:
    model = TargetModel.seeded(HybridConfig.tiny_default(), seed=0)
    model.kernel_backend = "triton"
    # every draft verified whole, as on CUDA: a static drafting shape, and the same windows
    # for both paths (the host path's would follow the drafter's confidence, the device
    # path's cannot)
    slots = max(BLOCK, tree_budget or 0)
    target = ShardedTarget(model, plan_shards(6, "cpu,cpu", "2,4"),
                           max_len=len(PROMPT) + n + slots + 1, max_draft=slots)
    if graphs:
        target.graphs = [ShardGraphs(s.device, capture=recorded_capture) for s in target.shards]
    dflash = _dflash(model, **(changes or {}))
    drafter = LookupAssistedDrafter(dflash) if lookup else dflash
    engine = SpecDecoder(target, drafter, block_size=BLOCK,
                         policy=RollbackPolicy(mode=mode), verify_window="full",
                         tree_budget=tree_budget)
    out = [engine.prefill(PROMPT)]
    while len(out) < n:
        out.extend(engine.step())
    return engine


@pytest.mark.usefixtures("record_launches")
def test_dflash_drafting_in_recorded_graphs_proposes_what_the_host_path_does(
    oracle: list[int],
) -> None:
    """With graphs the DFlash drafter drafts on the device: its step (context rows on the
    accepted count, the block after the new pending token) is a replayed graph of static
    buffers. Every draft equals the host path's (the cropped context cache), every token is
    plain greedy's (a sliding-window layer and a full one; remap). Commits of several
    lengths: tests/cpu/model/test_drafters_dflash_device.py."""
    changes = {"layer_types": ("sliding_attention", "full_attention"), "sliding_window": 3}
    host = _dflash_run("remap", 12, graphs=False, changes=changes)
    dev = _dflash_run("remap", 12, graphs=True, changes=changes)
    assert host.device_drafter is None and dev.device_drafter is not None
    drafts_h = [r.draft for r in host.records]
    drafts_d = [r.draft for r in dev.records]
    assert drafts_d == drafts_h
    tokens = [t for r in dev.records for t in r.emitted]
    assert tokens[:10] == oracle[1:11]
    g = dev.target.graphs
    assert g is not None
    assert ("draft", BLOCK, False) in g[0].captured_keys and not g[0].failures
    assert g[0].replays > 5


_SPEC_INIT = SpecDecoder.__init__


def _informed_trees(monkeypatch: pytest.MonkeyPatch, oracle: list[int], n: int,
                    lookup: bool, mode: RollbackMode, graphs: bool
                    ) -> tuple[SpecDecoder, list[tuple[int, ...]], list[list[int]]]:
    """A DFlash tree run whose per-slot candidates get plain greedy's token as their
    second best (the random drafter's own rarely match it), so accepted paths leave the
    trunk; returns the engine, every tree's tokens and every accepted path."""
    import dflash.execution.engine as engine_module
    from dflash.model.drafters.trees import accept_tree as accept
    from dflash.model.drafters.trees import best_first_tree as grow

    full = PROMPT + oracle
    held: list[SpecDecoder] = []
    trees: list[tuple[int, ...]] = []
    paths: list[list[int]] = []

    def informed(last: int, candidates: list[list[tuple[int, float]]], budget: int, *,
                 branch: list[int] | None = None) -> Any:
        at = held[0].committed  # the position of `last`
        slots = []
        for depth, slot in enumerate(candidates, start=1):
            want = full[at + depth] if at + depth < len(full) else None
            if want is not None and want not in [t for t, _ in slot]:
                slot = [slot[0], (want, slot[1][1]), *slot[2:]]
            slots.append(slot)
        tree = grow(last, slots, budget, branch=branch)
        trees.append(tree.tokens)
        return tree

    def accepted(tree: Any, t: list[int]) -> Any:
        found = accept(tree, t)
        paths.append(list(found[1]))
        return found

    monkeypatch.setattr(engine_module, "best_first_tree", informed)
    monkeypatch.setattr(engine_module, "accept_tree", accepted)
    def keep(self: SpecDecoder, *args: Any, **kwargs: Any) -> None:
        _SPEC_INIT(self, *args, **kwargs)
        held.append(self)

    monkeypatch.setattr(SpecDecoder, "__init__", keep)
    engine = _dflash_run(mode, n, graphs=graphs, tree_budget=TREE_BUDGET, lookup=lookup)
    return engine, trees, paths


@pytest.mark.parametrize(("mode", "lookup"), [("checkpoint", False), ("remap", True)])
@pytest.mark.usefixtures("record_launches")
def test_trees_drafted_in_recorded_graphs_are_the_host_paths_trees(
    oracle: list[int], mode: RollbackMode, lookup: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With graphs a tree step drafts on the device too: the drafting step's graph also
    ranks each slot's candidates, read back with the step's tokens, and the tree grows
    from them; the next proposal is drafted from the accepted path's rows and tokens
    (gathered on the device, off the trunk too). Every tree equals the host path's (a host
    proposal's candidates, a second read), alone or assisted by prompt lookup (its copy
    one branch); every token is plain greedy's."""
    host, host_trees, host_paths = _informed_trees(monkeypatch, oracle, 24, lookup, mode,
                                                   graphs=False)
    dev, dev_trees, dev_paths = _informed_trees(monkeypatch, oracle, 24, lookup, mode,
                                                graphs=True)
    assert host.device_drafter is None and dev.device_drafter is not None
    assert dev_trees == host_trees and dev_paths == host_paths
    assert max(len(t) for t in dev_trees) > BLOCK  # trees wider than the chain
    # accepted paths that leave the trunk: their nodes are not the slots 0, 1, 2, …
    assert any(p != list(range(len(p))) and len(p) > 1 for p in dev_paths), dev_paths
    tokens = [t for r in dev.records for t in r.emitted]
    assert tokens[:22] == oracle[1:23]
    g = dev.target.graphs
    assert g is not None
    assert ("draft", BLOCK, False) in g[0].captured_keys and not g[0].failures
    assert g[0].replays > 5


TREE_BUDGET = 7


def _tree_decode(
    oracle: list[int], mode: RollbackMode, n: int
) -> tuple[list[int], SpecDecoder, list[tuple[int, ...]]]:
    """Tree steps on a target whose graphs replay like CUDA graphs; returns the tokens, the
    engine and the parents of every tree drafted."""
    from dflash.model.drafters.trees import DraftTree, SyntheticTreeDrafter

    model = TargetModel.seeded(HybridConfig.tiny_default(), seed=0)
    model.kernel_backend = "triton"
    target = ShardedTarget(model, plan_shards(6, "cpu,cpu", "2,4"),
                           max_len=len(PROMPT) + n + TREE_BUDGET + 1, max_draft=TREE_BUDGET)
    target.graphs = [ShardGraphs(s.device, capture=recorded_capture) for s in target.shards]
    shapes: list[tuple[int, ...]] = []

    order = random.Random(6)

    class Recording(SyntheticTreeDrafter):
        """The synthetic tree with its nodes in a random order that keeps parents first
        (the same tree, other slots: another parents table every step)."""

        def draft_tree(self, context: list[int], last: int, budget: int,
                       depth: int) -> DraftTree:
            tree = super().draft_tree(context, last, budget, depth)
            slots, placed = [0], {0}
            while len(slots) < len(tree):
                ready = [u for u in range(len(tree)) if u not in placed
                         and tree.parents[u] in placed]
                slots.append(order.choice(ready))
                placed.add(slots[-1])
            new = {old: i for i, old in enumerate(slots)}
            tree = DraftTree(
                tuple(tree.tokens[u] for u in slots),
                tuple(-1 if u == 0 else new[tree.parents[u]] for u in slots),
                tuple(tree.log_probs[u] for u in slots),
            )
            shapes.append(tree.parents)
            return tree

    drafter = Recording(PROMPT + oracle, (0.4, 0.3, 0.2), model.config.vocab_size, seed=5)
    engine = SpecDecoder(target, drafter, block_size=BLOCK,
                         policy=RollbackPolicy(mode=mode), tree_budget=TREE_BUDGET)
    out = [engine.prefill(PROMPT)]
    while len(out) < n:
        out.extend(engine.step())
        if out != oracle[: len(out)]:
            break
    return out[:n], engine, shapes


@pytest.mark.parametrize("mode", ["checkpoint", "remap", "replay", "recompute"])
@pytest.mark.usefixtures("record_launches")
def test_tree_verifies_through_recorded_graphs_are_plain_greedy(
    oracle: list[int], mode: RollbackMode
) -> None:
    """A tree verify is a graph of its size: the node depths, path table and parents are
    device tables refilled before each replay, so trees of other shapes replay one graph
    and every token is plain greedy's, in every rollback mode. A fast mode's rollback —
    the accepted node found on the device, the state, conv window and K/V compaction from
    it — is a graph of the tree's size too, on every shard."""
    out, engine, shapes = _tree_decode(oracle, mode, 28)
    assert out == oracle[:28]
    graphs = engine.target.graphs
    assert graphs is not None
    sizes = {len(p) for p in shapes}
    for g in graphs:
        assert not g.failures, g.failures
        keys = [k for k in g.captured_keys if k[0] == "verify-tree"]
        assert keys, g.captured_keys
        rolled = [k for k in g.captured_keys if k[0] == f"rollback:tree:{mode}"]
        assert bool(rolled) == (mode != "replay"), g.captured_keys
        assert all(k[1] - 2 in sizes for k in rolled), (rolled, sizes)
    if mode != "replay":
        assert engine.counts["fast"] >= len(shapes) - 2, engine.counts
    replayed = [p for p in shapes if len(p) in {k[1] for k in keys}]
    assert len(set(replayed)) >= 3, (sizes, replayed)  # several shapes under one graph
    assert graphs[0].replays >= 5
