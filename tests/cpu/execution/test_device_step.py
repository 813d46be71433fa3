"""The device-resident step on CPU: acceptance computed on the device, the device copy of
the position, KV capacity, and the graph switch (CUDA graphs themselves: tests/gpu)."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
import torch
from torch.utils._pytree import tree_flatten

from dflash.execution import (
    ExecutionError,
    RollbackMode,
    RollbackPolicy,
    ShardedTarget,
    SpecDecoder,
    plan_shards,
)
from dflash.execution.engine import TokenAcceptance, leading_accepted
from dflash.execution.graphs import GraphKey, ShardCompute, ShardGraphs, ShardOutput
from dflash.model import TargetModel
from dflash.model.drafters import SyntheticDrafter


def test_device_acceptance_equals_the_host_rule() -> None:
    rng = random.Random(0)
    for _ in range(300):
        b = rng.randrange(2, 17)
        vocab = rng.choice([2, 3, 50])
        logits = torch.randn(b, vocab)
        t = logits.argmax(-1).tolist()
        # drafts that follow the target for a random prefix, then guess
        k = rng.randrange(0, b)
        d = [rng.randrange(vocab)] + [
            t[i] if i < k else rng.randrange(vocab) for i in range(b - 1)
        ]
        got_t, count = TokenAcceptance().on_device(logits, torch.tensor(d), None)
        assert got_t.tolist() == t
        assert count.shape == (1,) and int(count) == leading_accepted(d, t)
        assert 1 + k <= int(count) <= b


@pytest.mark.parametrize("mode", ["replay", "checkpoint", "remap", "recompute"])
def test_device_position_follows_every_step(
    tiny: TargetModel,
    greedy: Callable[..., list[int]],
    prompts: dict[str, list[int]],
    mode: RollbackMode,
) -> None:
    oracle = greedy("digits", 24)
    drafter = SyntheticDrafter(prompts["digits"] + oracle, 0.6, tiny.config.vocab_size, seed=1)
    target = ShardedTarget(tiny, plan_shards(6, "cpu,cpu", "2,4"), max_len=48, max_draft=4)
    engine = SpecDecoder(target, drafter, block_size=4, policy=RollbackPolicy(mode=mode))
    out = [engine.prefill(prompts["digits"])]
    while len(out) < 16:
        out.extend(engine.step())
        for shard in target.shards:
            pool = shard.caches.pool
            assert pool.position.tolist() == [pool.length] == [engine.committed]
    assert out[:16] == oracle[:16]


def test_kv_capacity_exhaustion_is_a_clear_error_before_the_verify(
    tiny: TargetModel, greedy: Callable[..., list[int]], prompts: dict[str, list[int]]
) -> None:
    prompt = prompts["digits"]  # 6 tokens
    oracle = greedy("digits", 24)
    drafter = SyntheticDrafter(prompt + oracle, 1.0, tiny.config.vocab_size, seed=1)
    target = ShardedTarget(tiny, plan_shards(6), max_len=len(prompt) + 6, max_draft=4)
    engine = SpecDecoder(target, drafter, block_size=4, policy=RollbackPolicy(mode="remap"))
    engine.prefill(prompt)
    engine.step()  # all 4 accepted: committed 10, a verify of 4 needs 14 > 12
    with pytest.raises(ExecutionError, match=r"capacity exhausted.*needs 14 positions.*max_len=12"):
        engine.step()
    assert engine.committed == 10 and engine.life.phase.value == "clean"  # nothing ran


def test_graphs_are_refused_with_the_reason_on_cpu(tiny: TargetModel) -> None:
    plan = plan_shards(6)
    with pytest.raises(ValueError, match="'graphs'=True but CUDA graphs need every shard"):
        ShardedTarget(tiny, plan, max_len=16, max_draft=4, graphs=True)
    auto = ShardedTarget(tiny, plan, max_len=16, max_draft=4)
    assert auto.graphs is None and auto.graphs_off_reason is not None


def _stand_in_capture(
    work: Callable[[], object],
) -> tuple[Callable[[], None], object]:
    """A CPU stand-in for a CUDA graph: the capture call does the work once (a real capture
    records it and the first replay runs it); every later replay does it again and writes
    the results into the captured output tensors, as a graph replay does (a forward's
    ShardOutput, the drafter's guesses, an acceptance's tensors; a rollback returns
    nothing). The work re-runs on what it captured, as a graph reads the addresses it was
    captured on."""
    outputs = work()
    fresh = [True]

    def replay() -> None:
        if fresh[0]:
            fresh[0] = False
            return
        again = work()
        mine, theirs = tree_flatten(outputs)[0], tree_flatten(again)[0]
        assert len(mine) == len(theirs)
        for out, new in zip(mine, theirs, strict=True):
            if isinstance(out, torch.Tensor):
                out.copy_(new)

    return replay, outputs


@pytest.mark.parametrize("mode", ["replay", "checkpoint", "remap", "recompute"])
def test_graph_path_bookkeeping_on_cpu_stand_in(
    tiny: TargetModel,
    greedy: Callable[..., list[int]],
    prompts: dict[str, list[int]],
    mode: RollbackMode,
) -> None:
    """Warm-up, capture and replay per (mode, T, live slot), static inputs, outputs reused
    across replays, host bookkeeping around the device work: with the stand-in, the graph
    path decodes the same greedy tokens, and storage rebuilds drop the graphs."""
    oracle = greedy("repeat", 40)
    drafter = SyntheticDrafter(prompts["repeat"] + oracle, 0.6, tiny.config.vocab_size, seed=2)
    target = ShardedTarget(tiny, plan_shards(6, "cpu,cpu", "3,3"), max_len=64, max_draft=4)
    target.graphs = [ShardGraphs(s.device, capture=_stand_in_capture) for s in target.shards]
    engine = SpecDecoder(target, drafter, block_size=4, policy=RollbackPolicy(mode=mode))
    out = [engine.prefill(prompts["repeat"])]
    while len(out) < 20:
        out.extend(engine.step())
    engine.rebuild_storage()
    while len(out) < 36:
        out.extend(engine.step())
    assert out[:36] == oracle[:36]
    for g in target.graphs:
        assert g.captures >= 2 and g.replays >= 4 and not g.failures, (g.captures, g.replays)
        assert (("rollback:" + mode, 1, False) in g.captured_keys) == (mode != "replay")
    assert engine.counts["replay_after_failure"] == 0


def test_static_work_runs_eager_then_captured_and_bind_drops_only_its_kind() -> None:
    """``run_static``: eager on the first call of a key, captured on the second, replayed
    after; ``bind`` with another owner drops that kind's graphs (and their warm-up), never
    another kind's."""
    calls: list[str] = []
    g = ShardGraphs(torch.device("cpu"), capture=_stand_in_capture)

    def work() -> None:
        calls.append("work")

    key = ("draft", 4, False)
    g.bind("draft", "drafter A")
    for _ in range(3):  # eager; captured (the capture is its run); replayed (a run again)
        g.run_static(key, work)
    assert len(calls) == 3 and (g.captures, g.replays) == (1, 2)
    g.run_rollback("checkpoint", torch.ones(1, dtype=torch.int64), lambda n: None)
    g.run_rollback("checkpoint", torch.ones(1, dtype=torch.int64), lambda n: None)
    assert ("rollback:checkpoint", 1, False) in g.captured_keys
    g.bind("draft", "drafter A")  # the same owner: nothing dropped
    assert key in g.captured_keys
    g.bind("draft", "drafter B")
    assert key not in g.captured_keys and ("rollback:checkpoint", 1, False) in g.captured_keys
    g.run_static(key, work)  # warm-up forgotten too: eager again, then a new capture
    assert g.captures == 2
    g.run_static(key, work)
    assert g.captures == 3 and key in g.captured_keys


def test_a_count_disagreement_puts_the_enqueued_rollback_back(
    tiny: TargetModel, greedy: Callable[..., list[int]], prompts: dict[str, list[int]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """If the host's recount disagrees with the device's, the step raises before anything
    is committed, and the fast rollback it had already enqueued is undone: every shard is
    back at its pre-verify position with the live state home and equal to the snapshot."""
    import dflash.execution.engine as engine_module

    oracle = greedy("repeat", 24)
    drafter = SyntheticDrafter(prompts["repeat"] + oracle, 0.9, tiny.config.vocab_size, seed=2)
    for mode in ("checkpoint", "remap", "recompute"):
        target = ShardedTarget(tiny, plan_shards(6, "cpu,cpu", "3,3"), max_len=64, max_draft=4)
        engine = SpecDecoder(target, drafter, block_size=4, policy=RollbackPolicy(mode=mode))
        engine.prefill(prompts["repeat"])
        while engine.counts["fast"] < 2:  # a remap leaves a live slot behind
            engine.step()
        committed = engine.committed
        monkeypatch.setattr(engine_module, "leading_accepted", lambda d, t: -1)
        with pytest.raises(ExecutionError, match="disagrees"):
            engine.step()
        monkeypatch.undo()
        assert engine.committed == committed
        for shard in target.shards:
            pool = shard.caches.pool
            assert pool.position.tolist() == [committed] and pool.length == committed
            assert pool.live_slot is None and pool.live.tolist() == [-1]
            assert torch.equal(pool.state, pool.snapshot)
            # the enqueued rollback was put back: the pre-verify state, on record
            assert pool.verify is not None and pool.verify.stage == "restored"
            assert pool.verify.start == committed


def test_the_host_revises_the_device_drafters_guesses_on_cpu_stand_in(
    tiny: TargetModel, greedy: Callable[..., list[int]], prompts: dict[str, list[int]]
) -> None:
    """A RevisingDrafter drafting on the device (``dflash+lookup``): after each step's read
    the engine hands ``revise`` the device's guesses, with the committed context and the
    pending token, and verifies what it returns; tokens stay greedy."""
    from dflash.model.drafters import DFlashConfig, DFlashDrafter, LookupAssistedDrafter

    cfg = DFlashConfig.for_target(
        hidden_size=64, vocab_size=256, num_target_layers=6, num_hidden_layers=2, block_size=4
    )
    inner = DFlashDrafter.random(cfg, tiny.embed_tokens.weight, tiny.lm_head.weight, seed=2)
    hybrid = LookupAssistedDrafter(inner)
    seen: list[tuple[list[int], int, list[int], list[int]]] = []
    revise = hybrid.revise

    def spy(context: list[int], last: int, guesses: list[int]) -> list[int]:
        out = revise(context, last, guesses)
        seen.append((list(context), last, list(guesses), out))
        return out

    hybrid.revise = spy  # type: ignore[method-assign]  # records each call
    prompt = prompts["repeat"]
    oracle = greedy("repeat", 40)
    target = ShardedTarget(tiny, plan_shards(6, "cpu"), max_len=64, max_draft=4)
    target.graphs = [ShardGraphs(s.device, capture=_stand_in_capture) for s in target.shards]
    engine = SpecDecoder(target, hybrid, block_size=4, policy=RollbackPolicy(mode="checkpoint"))
    out = [engine.prefill(prompt)]
    while len(out) < 24:
        out.extend(engine.step())
    assert engine.device_drafter is hybrid
    assert len(seen) == len(engine.records) == hybrid.drafts
    committed = list(prompt)
    for (context, last, _, verified), record in zip(seen, engine.records, strict=True):
        assert (context, last) == (committed, record.draft[0])
        assert list(record.draft[1:]) == verified[: len(record.draft) - 1]
        committed += list(record.draft[: record.accept_n])
    assert out[:24] == oracle[:24]


class _Recorded(ShardGraphs):
    """Stand-in graphs that record each forward's key and whether a graph replayed it."""

    def __init__(self, device: torch.device) -> None:
        super().__init__(device, capture=_stand_in_capture)
        self.calls: list[tuple[GraphKey, bool]] = []

    def run(
        self,
        key: GraphKey,
        x: torch.Tensor,
        compute: ShardCompute,
        on_layer: Callable[[int], None] | None,
    ) -> ShardOutput:
        self.calls.append((key, key in self.captured_keys))
        return super().run(key, x, compute, on_layer)


def _generation(
    tiny: TargetModel,
    prompt: list[int],
    oracle: list[int],
    target: ShardedTarget,
    graphs: list[_Recorded],
    before_gate: Callable[[], None] | None = None,
) -> tuple[SpecDecoder, list[int], list[list[tuple[GraphKey, bool]]]]:
    """A checkpoint-mode generation of 20 tokens on ``target``: the engine, its tokens and,
    per shard, the forwards of the gate's step (its first). ``before_gate`` runs just
    before that step."""
    drafter = SyntheticDrafter(prompt + oracle, 0.6, tiny.config.vocab_size, seed=2)
    engine = SpecDecoder(target, drafter, block_size=4, policy=RollbackPolicy(mode="checkpoint"))
    out = [engine.prefill(prompt)]
    for g in graphs:
        g.calls.clear()
    if before_gate is not None:
        before_gate()
    out.extend(engine.step())
    gate_calls = [list(g.calls) for g in graphs]
    while len(out) < 20:
        out.extend(engine.step())
    return engine, out, gate_calls


def _kept_target(
    tiny: TargetModel, prompt: list[int], oracle: list[int]
) -> tuple[ShardedTarget, list[_Recorded]]:
    """Two CPU shards with recording stand-in graphs, after one generation (graphs captured)."""
    target = ShardedTarget(tiny, plan_shards(6, "cpu,cpu", "3,3"), max_len=64, max_draft=4)
    graphs = [_Recorded(s.device) for s in target.shards]
    target.graphs = list(graphs)
    _generation(tiny, prompt, oracle, target, graphs)
    return target, graphs


def test_the_capture_gate_judges_the_graphed_verify_on_cpu_stand_in(
    tiny: TargetModel, greedy: Callable[..., list[int]], prompts: dict[str, list[int]]
) -> None:
    """On a target whose verify graph exists (a kept target), the gate's step replays it on
    every shard, with the gate's checks between the shards, and validates: the evidence
    comes from the path every later fast step runs."""
    prompt, oracle = prompts["repeat"], greedy("repeat", 40)
    target, graphs = _kept_target(tiny, prompt, oracle)
    engine, out, gate_calls = _generation(tiny, prompt, oracle, target, graphs)
    assert out[:20] == oracle[:20]
    assert engine.gate.report.verdict == "validated", engine.gate.report.reason
    assert engine.records[0].path == "replay" and engine.counts["fast"] == len(engine.records) - 1
    for calls in gate_calls:  # per shard: the gate's verify, then the self-test's replay
        assert [key[0] for key, _ in calls] == ["verify", "replay"], calls
        assert calls[0][1], f"the gate's verify ran eagerly: {calls}"


def test_a_graphed_gate_verify_that_leaves_a_slot_unwritten_is_refused_on_cpu_stand_in(
    tiny: TargetModel, greedy: Callable[..., list[int]], prompts: dict[str, list[int]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """If the replayed verify graph does not write a checkpoint slot (here: slot 2 of the
    second shard's first recurrent layer is put back to NaN after the replay), the gate
    refuses naming it, and the generation stays lossless on the replay path."""
    prompt, oracle = prompts["repeat"], greedy("repeat", 40)
    target, graphs = _kept_target(tiny, prompt, oracle)
    pool = target.shards[1].caches.pool
    armed = [False]
    original = ShardGraphs._run

    def run(self: ShardGraphs, key: GraphKey, x: torch.Tensor, eager: Callable[[], object],
            work: Callable[[torch.Tensor], object]) -> object:
        out = original(self, key, x, eager, work)
        if armed[0] and key[0] == "verify" and self is graphs[1]:
            armed[0] = False
            pool.checkpoints[0, :, 2] = float("nan")
        return out

    def arm() -> None:
        armed[0] = True

    monkeypatch.setattr(ShardGraphs, "_run", run)
    engine, out, _ = _generation(tiny, prompt, oracle, target, graphs, arm)
    assert not armed[0], "the gate's verify never ran on shard 1's graph"
    report = engine.gate.report
    assert report.verdict == "refused", report
    first = pool.layer_ids[0]
    assert report.reason is not None and f"layer {first} slot 2" in report.reason, report.reason
    assert engine.counts["fast"] == 0 and out[:20] == oracle[:20]


def test_forward_takes_the_ids_uploaded_once_and_refuses_a_malformed_tensor(
    tiny: TargetModel, prompts: dict[str, list[int]]
) -> None:
    """``ShardedTarget.forward`` on ``device_ids(ids)`` equals the same forward on the list;
    a tensor of the wrong shape, dtype or device is refused naming what it got."""
    from dflash.execution.engine import chain_of
    from dflash.execution.shards import device_ids

    prompt = prompts["digits"]
    outs = []
    for as_tensor in (False, True):
        target = ShardedTarget(tiny, plan_shards(6), max_len=32, max_draft=4)
        target.forward(prompt, "prefill", 0)
        d = [5, 6, 7, 8]
        ids = device_ids(d, torch.device("cpu")) if as_tensor else d
        logits, _ = target.forward(ids, "verify", len(prompt), geometry=chain_of(4))
        outs.append(logits)
    assert torch.equal(outs[0], outs[1])
    target = ShardedTarget(tiny, plan_shards(6), max_len=32, max_draft=4)
    target.forward(prompt, "prefill", 0)
    for bad, named in (
        (torch.tensor([5, 6]), r"\[2\] torch.int64"),
        (torch.tensor([[5, 6]], dtype=torch.int32), r"\[1, 2\] torch.int32"),
        (torch.tensor([[5, 6], [7, 8]]), r"\[2, 2\] torch.int64"),
    ):
        with pytest.raises(ValueError, match=r"must be \[1, T\] int64 on cpu \(got " + named):
            target.forward(bad, "verify", len(prompt), geometry=chain_of(2))
    assert target.shards[0].caches.pool.length == len(prompt)  # nothing ran


def test_a_new_drafting_rule_between_steps_drops_the_captured_drafting_step(
    tiny: TargetModel, greedy: Callable[..., list[int]], prompts: dict[str, list[int]]
) -> None:
    """The device drafter's step is captured with its sampling rule: coupling it to another
    rule between steps drops that graph (the next step runs it eagerly, the one after
    captures it again), and the tokens stay the target's."""
    from dflash.model.drafters import DFlashConfig, DFlashDrafter
    from dflash.sampling import SamplingParams

    cfg = DFlashConfig.for_target(
        hidden_size=64, vocab_size=256, num_target_layers=6, num_hidden_layers=2, block_size=4
    )
    drafter = DFlashDrafter.random(cfg, tiny.embed_tokens.weight, tiny.lm_head.weight, seed=2)
    prompt, oracle = prompts["repeat"], greedy("repeat", 40)
    target = ShardedTarget(tiny, plan_shards(6, "cpu"), max_len=64, max_draft=4)
    target.graphs = [ShardGraphs(s.device, capture=_stand_in_capture) for s in target.shards]
    engine = SpecDecoder(target, drafter, block_size=4, policy=RollbackPolicy(mode="checkpoint"))
    out = [engine.prefill(prompt)]
    for _ in range(3):
        out.extend(engine.step())
    key = ("draft", 4, False)
    assert key in target.graphs[0].captured_keys
    drafter.couple(SamplingParams(temperature=1.0, seed=3))
    out.extend(engine.step())
    assert key not in target.graphs[0].captured_keys  # dropped: this step ran it eagerly
    out.extend(engine.step())
    assert key in target.graphs[0].captured_keys
    while len(out) < 24:
        out.extend(engine.step())
    assert out[:24] == oracle[:24]
