"""The capture gate: refusal on every kind of bad evidence, the self-test, stickiness, reset."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import cast

import pytest
import torch

from dflash.execution import (
    CaptureGate,
    RollbackMode,
    RollbackPolicy,
    RollbackStatus,
    ShardedTarget,
    SpecDecoder,
    chain_of,
    plan_shards,
)
from dflash.execution.capture_gate import ShardStorage
from dflash.model import TargetModel
from dflash.model.caches import CaptureKind
from dflash.model.drafters import SyntheticDrafter

T = 3  # verify slots; the pools hold S = 4, so slot 3 must stay untouched


def _verify_with_gate(
    tiny: TargetModel,
    corrupt_during: Callable[[int, list[ShardStorage]], None] | None = None,
    capture: CaptureKind = "states",
) -> tuple[CaptureGate, ShardedTarget, list[ShardStorage], dict[int, torch.Tensor]]:
    target = ShardedTarget(
        tiny, plan_shards(6, "cpu,cpu", "3,3"), max_len=32, max_draft=4, capture=capture
    )
    target.forward([1, 2, 3, 4, 5], "prefill", 0)
    gate = CaptureGate(requested=True, tolerance=1e-4)
    storages = target.storages()
    gate.arm(storages)
    for s in storages:
        for buffer in s.pool.capture_buffers().values():
            assert torch.isnan(buffer).all()  # poisoned before the verify

    def after(k: int) -> None:
        if corrupt_during is not None:
            corrupt_during(k, storages)
        gate.after_shard(k, storages)

    _, taps = target.forward(
        [9, 8, 7], "verify", 5, geometry=chain_of(T), taps=(1, 4), after_shard=after
    )
    return gate, target, storages, taps


def test_clean_verify_passes_every_check(tiny: TargetModel) -> None:
    gate, _, storages, taps = _verify_with_gate(tiny)
    assert gate.judge(storages, T, taps, (1, 4))
    shards = gate.report.shards
    assert [e.recurrent_layers for e in shards] == [(0, 1), (3, 4)]
    assert all(e.ok and e.checkpoint_dtype == "float32" and e.slots_expected == T for e in shards)
    assert [e.taps_expected for e in shards] == [(1,), (4,)]
    assert gate.report.verdict == "not_run"  # evidence ok; the self-test decides


@pytest.mark.parametrize(
    ("name", "tamper", "message"),
    [
        (
            "missing storage",
            lambda s: setattr(s[1].pool, "checkpoints", torch.empty(0)),
            "capture storage missing",
        ),
        (
            "wrong dtype",
            lambda s: setattr(s[0].pool, "checkpoints", s[0].pool.checkpoints.double()),
            "must be float32",
        ),
        (
            "unwritten slot",
            lambda s: s[1].pool.checkpoints[1, :, 2].fill_(float("nan")),
            "unwritten, first layer 4 slot 2",
        ),
        (
            "unwritten conv row",
            lambda s: s[0].pool.captured[0, :, 4].fill_(float("nan")),
            "layer 0 captured row 4",
        ),
        (
            "slot past the verify",
            lambda s: s[0].pool.checkpoints[0, :, T].zero_(),
            "a slot past the verify's 3 was written",
        ),
        (
            "wrong shape",
            lambda s: setattr(s[0].pool, "checkpoints", s[0].pool.checkpoints[:, :, :, :2]),
            "checkpoints shape",
        ),
    ],
)
def test_gate_refuses_bad_evidence(
    tiny: TargetModel, name: str, tamper: Callable[[list[ShardStorage]], None], message: str
) -> None:
    gate, _, storages, taps = _verify_with_gate(tiny)
    tamper(storages)
    assert not gate.judge(storages, T, taps, (1, 4)), name
    assert gate.report.verdict == "refused"
    assert message in (gate.report.reason or "")
    assert not gate.pending  # sticky: no second attempt until the storage is rebuilt


def test_gate_refuses_a_write_into_another_shards_storage(tiny: TargetModel) -> None:
    def shard0_writes_shard1(k: int, storages: list[ShardStorage]) -> None:
        if k == 0:
            storages[1].pool.checkpoints[0, :, 0].zero_()

    gate, _, storages, taps = _verify_with_gate(tiny, shard0_writes_shard1)
    assert not gate.judge(storages, T, taps, ())
    assert "non-owner write" in (gate.report.reason or "")
    assert gate.report.shards[1].non_owner_writes


def test_gate_refuses_a_later_shard_rewriting_an_earlier_one(tiny: TargetModel) -> None:
    def shard1_writes_shard0(k: int, storages: list[ShardStorage]) -> None:
        if k == 1:
            storages[0].pool.checkpoints[1, :, 1].add_(1.0)

    gate, _, storages, taps = _verify_with_gate(tiny, shard1_writes_shard0)
    assert not gate.judge(storages, T, taps, ())
    assert "shard 0's storage changed while shard 1 ran" in (gate.report.reason or "")


def test_gate_refuses_when_the_pool_did_not_record_every_owned_layer(
    tiny: TargetModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    gate, _, storages, taps = _verify_with_gate(tiny)
    pool_type = type(storages[0].pool)
    monkeypatch.setattr(pool_type, "verified_layers", property(lambda self: self.layer_ids[:1]))
    assert not gate.judge(storages, T, taps, ())
    assert "the pool reports the verify wrote layers [0], the shard owns [0, 1]" in (
        gate.report.reason or ""
    )


def test_gate_refuses_ownership_map_mismatch_and_missing_taps(tiny: TargetModel) -> None:
    gate, _, storages, taps = _verify_with_gate(tiny)
    lying = [storages[0], ShardStorage(**{**storages[1].__dict__, "owned_recurrent": (3,)})]
    assert not gate.judge(lying, T, taps, ())
    assert "pool holds recurrent layers [3, 4] but the shard owns [3]" in (gate.report.reason or "")
    gate2, _, storages2, _ = _verify_with_gate(tiny)
    assert not gate2.judge(storages2, T, {}, (1,))
    assert "tap-layer features not written for layers [1]" in (gate2.report.reason or "")


# -- end to end: the engine's status follows the gate --------------------------------------


def _engine(
    tiny: TargetModel, oracle: list[int], prompt: list[int], mode: RollbackMode
) -> SpecDecoder:
    target = ShardedTarget(tiny, plan_shards(6, "cpu,cpu", "3,3"), max_len=64, max_draft=4)
    drafter = SyntheticDrafter(prompt + oracle, 0.6, tiny.config.vocab_size, seed=2)
    return SpecDecoder(target, drafter, block_size=4, policy=RollbackPolicy(mode=mode))


def _off_by_one(
    save: Callable[..., list[tuple[torch.Tensor, torch.Tensor]]],
) -> Callable[..., list[tuple[torch.Tensor, torch.Tensor]]]:
    """A ``save_slot`` that saves the slot next to the one asked for (a chain's)."""

    def saved(
        shards: Sequence[ShardStorage], slot: int, path: Sequence[int] | None = None
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return save(shards, slot + 1 if slot == 0 else slot - 1)

    return saved


def _decode(engine: SpecDecoder, prompt: list[int], n: int) -> list[int]:
    out = [engine.prefill(prompt)]
    while len(out) < n:
        out.extend(engine.step())
    return out[:n]


def test_refused_gate_keeps_requested_status_and_replays(
    tiny: TargetModel, greedy: Callable[[str, int], list[int]], prompts: dict[str, list[int]]
) -> None:
    oracle = greedy("digits", 16)
    engine = _engine(tiny, oracle, prompts["digits"], "remap")
    original = engine.gate.after_shard

    def non_owner(k: int, shards: Sequence[ShardStorage]) -> None:
        if k == 0:
            shards[1].pool.captured[0, :, 0].zero_()
        original(k, shards)

    engine.gate.after_shard = non_owner  # type: ignore[method-assign]  # test double
    assert engine.status is RollbackStatus.REQUESTED
    assert _decode(engine, prompts["digits"], 12) == oracle[:12]
    assert engine.status is RollbackStatus.REQUESTED  # never "effective", never "on"
    assert engine.gate.report.verdict == "refused"
    assert all(r.path == "replay" for r in engine.records)


def test_self_test_catches_an_off_by_one_slot(
    tiny: TargetModel, greedy: Callable[[str, int], list[int]], prompts: dict[str, list[int]]
) -> None:
    oracle = greedy("digits", 16)
    engine = _engine(tiny, oracle, prompts["digits"], "checkpoint")
    original = CaptureGate.save_slot
    engine.gate.save_slot = _off_by_one(original)  # type: ignore[method-assign]  # test double
    assert _decode(engine, prompts["digits"], 8) == oracle[:8]
    report = engine.gate.report
    assert report.verdict == "refused" and "numerical self-test" in (report.reason or "")
    assert report.self_test is not None and not report.self_test.passed
    assert engine.counts["fast"] == 0


def test_self_test_fails_on_a_non_finite_replay(tiny: TargetModel) -> None:
    """A replayed state holding NaN must fail the self-test, not pass with error 0."""
    gate, _, storages, taps = _verify_with_gate(tiny)
    assert gate.judge(storages, T, taps, (1, 4))
    saved = CaptureGate.save_slot(storages, 0)
    for s in storages:  # the "replay": the live state restored from slot 0 ...
        s.pool.state.copy_(s.pool.checkpoints[:, :, 0])
        s.pool.conv.copy_(s.pool.captured[:, :, 1 : s.pool.conv_kernel])
    storages[1].pool.state[0].fill_(float("nan"))  # ... with one layer broken
    gate.self_test(storages, 0, saved, step=0)
    report = gate.report
    assert report.verdict == "refused" and report.self_test is not None
    assert not report.self_test.passed and report.self_test.rel_err == float("inf")


def test_gate_is_sticky_and_resets_on_storage_rebuild(
    tiny: TargetModel, greedy: Callable[[str, int], list[int]], prompts: dict[str, list[int]]
) -> None:
    oracle = greedy("digits", 28)
    engine = _engine(tiny, oracle, prompts["digits"], "remap")
    out = [engine.prefill(prompts["digits"])]
    out += engine.step()
    report = engine.gate.report
    assert report.verdict == "validated" and report.validated_at_step == 0
    assert report.self_test is not None and report.self_test.passed
    assert report.self_test.rel_err <= 1e-4
    out += engine.step()
    out += engine.step()
    assert engine.gate.report is report  # sticky: no new evidence collected
    assert engine.target.shards[0].caches.pool.live_slot is not None  # live state in a slot
    engine.rebuild_storage()
    assert engine.status is RollbackStatus.REQUESTED
    assert engine.gate.report.storage_generation == 1
    step = len(engine.records)
    out += engine.step()
    assert engine.records[-1].path == "replay"
    assert engine.gate.report.validated_at_step == step
    while len(out) < 24:
        out += engine.step()
    assert out[:24] == oracle[:24]
    # the cast: mypy would keep the status narrowed by the assert above across the steps
    assert cast(RollbackStatus, engine.status) is RollbackStatus.EFFECTIVE


# -- the recompute mode's storage: the recurrence's inputs ---------------------------------


def test_inputs_capture_clean_verify_passes_every_check(tiny: TargetModel) -> None:
    gate, _, storages, taps = _verify_with_gate(tiny, capture="inputs")
    assert gate.judge(storages, T, taps, (1, 4))
    shards = gate.report.shards
    assert all(e.ok and e.capture == "inputs" and e.checkpoint_dtype == "float32" for e in shards)


@pytest.mark.parametrize(
    ("tamper", "message"),
    [
        (lambda s: setattr(s[1].pool, "g", None), "capture storage missing (g)"),
        (lambda s: setattr(s[0].pool, "g", s[0].pool.g.double()), "g must be float32"),
        (lambda s: s[1].pool.inputs[0, :, 1].fill_(float("nan")), "first layer 3 inputs slot 1"),
        (lambda s: s[0].pool.beta[1, :, 2].fill_(float("nan")), "first layer 1 beta slot 2"),
        (lambda s: s[0].pool.g[0, :, T].zero_(), "layer 0: a g slot past the verify's 3"),
        (
            lambda s: setattr(s[0].pool, "inputs", s[0].pool.inputs[:, :, :, :5]),
            "inputs shape (2, 1, 4, 5) does not match",
        ),
        (lambda s: setattr(s[0].pool, "beta", s[0].pool.beta[:, :, :2]), "beta holds 2 slots"),
    ],
)
def test_gate_refuses_bad_input_evidence(
    tiny: TargetModel, tamper: Callable[[list[ShardStorage]], None], message: str
) -> None:
    gate, _, storages, taps = _verify_with_gate(tiny, capture="inputs")
    tamper(storages)
    assert not gate.judge(storages, T, taps, (1, 4))
    assert message in (gate.report.reason or ""), gate.report.reason


def test_recompute_gate_validates_bitwise_and_rolls_back_fast(
    tiny: TargetModel, greedy: Callable[[str, int], list[int]], prompts: dict[str, list[int]]
) -> None:
    oracle = greedy("digits", 24)
    engine = _engine(tiny, oracle, prompts["digits"], "recompute")
    assert engine.target.capture == "inputs"  # the engine gave the target the mode's storage
    assert _decode(engine, prompts["digits"], 24) == oracle[:24]
    report = engine.gate.report
    assert report.verdict == "validated" and report.self_test is not None
    assert report.self_test.max_abs_err == 0.0  # the recomputed state is the replayed one
    assert engine.status is RollbackStatus.EFFECTIVE and engine.counts["fast"] > 0


def test_recompute_self_test_catches_an_off_by_one_count(
    tiny: TargetModel, greedy: Callable[[str, int], list[int]], prompts: dict[str, list[int]]
) -> None:
    oracle = greedy("digits", 16)
    engine = _engine(tiny, oracle, prompts["digits"], "recompute")
    original = CaptureGate.save_slot
    engine.gate.save_slot = _off_by_one(original)  # type: ignore[method-assign]  # test double
    assert _decode(engine, prompts["digits"], 8) == oracle[:8]
    report = engine.gate.report
    assert report.verdict == "refused" and "numerical self-test" in (report.reason or "")
    assert engine.counts["fast"] == 0


def test_switching_to_recompute_rebuilds_the_storage_and_runs_the_gate_again(
    tiny: TargetModel, greedy: Callable[[str, int], list[int]], prompts: dict[str, list[int]]
) -> None:
    oracle = greedy("digits", 40)
    engine = _engine(tiny, oracle, prompts["digits"], "checkpoint")
    out = [engine.prefill(prompts["digits"])]
    while engine.counts["fast"] < 2:
        out.extend(engine.step())
    states_bytes = engine.target.checkpoint_bytes
    engine.request_mode("recompute")
    assert engine.target.capture == "inputs" and engine.target.checkpoint_bytes < states_bytes
    assert engine.gate.report.verdict == "not_run"  # the new storage is judged afresh
    fast = engine.counts["fast"]
    while len(out) < 40:
        out.extend(engine.step())
    assert out[:40] == oracle[:40]
    assert engine.gate.validated and engine.counts["fast"] > fast
