"""The capture gate's checks one by one, on small hand-built storage (milliseconds per
test), pinned tightly enough that a mutant of ``dflash/execution/capture_gate.py`` fails
here (``python -m mutation --only dflash/execution/capture_gate.py``).

The pools are plain namespaces with exactly the attributes the gate reads (its duck-typed
interface), so each test sets up one kind of evidence without running a model.
"""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any, cast

import pytest
import torch

from dflash.execution.capture_gate import CaptureGate, ShardStorage, rel_err

L, B, HV, K, V = 2, 1, 1, 2, 2  # layers per shard, batch, heads, key, value
S, KC, C = 4, 3, 3  # slots, conv kernel, conv channels
T = 3  # slots a verify writes


def pool(layers: tuple[int, ...] = (0, 1), *, slots: int = S) -> Any:
    n = len(layers)
    return SimpleNamespace(
        layer_ids=layers, verified_layers=layers, live_slot=None, conv_kernel=KC,
        checkpoints=torch.zeros(n, B, slots, HV, K, V),
        captured=torch.zeros(n, B, KC - 1 + slots, C),
        state=torch.zeros(n, B, HV, K, V), conv=torch.zeros(n, B, KC - 1, C))


def shard(index: int, layers: tuple[int, int], owned: tuple[int, ...],
          p: Any = None) -> ShardStorage:
    return ShardStorage(index=index, device="cpu", layers=layers, owned_recurrent=owned,
                        pool=pool(owned) if p is None else p, state_shape=(B, HV, K, V),
                        conv_rows_shape=(B, KC - 1, C))


def two_shards() -> list[ShardStorage]:
    return [shard(0, (0, 3), (0, 1)), shard(1, (3, 6), (3, 4))]


def write_verify(s: ShardStorage, value: float = 1.0, n: int = T) -> None:
    """What a clean verify of ``n`` slots writes into the shard's storage."""
    if not s.owned_recurrent:
        return
    s.pool.checkpoints[:, :, :n] = value
    s.pool.captured[:, :, : KC - 1 + n] = value


def run_verify(gate: CaptureGate, shards: list[ShardStorage], n: int = T) -> None:
    gate.arm(shards)
    for k, s in enumerate(shards):
        write_verify(s, float(k + 1), n)
        gate.after_shard(k, shards)


TAPS = {1: torch.ones(2), 4: torch.ones(2)}


def judged(tamper: Any = None, *, taps: Any = None, expected: tuple[int, ...] = (1, 4),
           n: int = T) -> tuple[bool, CaptureGate, list[ShardStorage]]:
    gate = CaptureGate(requested=True, tolerance=1e-4)
    shards = two_shards()
    run_verify(gate, shards, n)
    if tamper is not None:
        tamper(shards)
    ok = gate.judge(shards, n, TAPS if taps is None else taps, expected)
    return ok, gate, shards


def test_shard_storage_is_a_frozen_value() -> None:
    s = shard(0, (0, 3), (0, 1))
    with pytest.raises(AttributeError, match="cannot assign"):
        s.index = 1  # type: ignore[misc]  # mutation attempt on purpose
    assert s == ShardStorage(**s.__dict__)


# -- lifecycle ------------------------------------------------------------------------------


def test_unrequested_gate_does_nothing() -> None:
    gate = CaptureGate(requested=False, tolerance=0.5)
    assert (gate.requested, gate.tolerance, gate.pending, gate.validated) == (False, 0.5, False,
                                                                                False)
    assert gate.report.requested is False and gate.report.verdict == "not_run"
    shards = two_shards()
    gate.arm(shards)
    assert not torch.isnan(shards[0].pool.checkpoints).any()  # not poisoned
    assert gate.judge(shards, T, TAPS, (1, 4)) is False
    assert gate.report.verdict == "not_run"


def test_request_makes_the_gate_pending() -> None:
    gate = CaptureGate(requested=False, tolerance=1e-4)
    gate.request()
    assert gate.requested and gate.pending and gate.report.requested
    assert not gate.validated


def test_arm_poisons_every_tensor_and_refuses_a_live_slot() -> None:
    gate = CaptureGate(requested=True, tolerance=1e-4)
    shards = two_shards()
    gate.arm(shards)
    for s in shards:
        assert torch.isnan(s.pool.checkpoints).all() and torch.isnan(s.pool.captured).all()
        assert not torch.isnan(s.pool.state).any()  # the live state is not capture storage
    moved = two_shards()
    moved[1].pool.live_slot = 2
    with pytest.raises(Exception, match="live state lies in a slot"):
        CaptureGate(requested=True, tolerance=1e-4).arm(moved)


def test_judge_needs_an_armed_gate_and_disarms() -> None:
    gate = CaptureGate(requested=True, tolerance=1e-4)
    shards = two_shards()
    assert gate.judge(shards, T, TAPS, (1, 4)) is False  # never armed
    assert gate.report.verdict == "not_run"
    run_verify(gate, shards)
    assert gate.judge(shards, T, TAPS, (1, 4)) is True
    assert gate.judge(shards, T, TAPS, (1, 4)) is False  # evidence is used once


def test_clean_evidence_is_recorded_field_by_field() -> None:
    ok, gate, _ = judged()
    assert ok and gate.report.verdict == "not_run" and gate.report.reason is None
    first, second = gate.report.shards
    assert (first.shard, first.device, first.layers, first.recurrent_layers) == (
        0, "cpu", (0, 3), (0, 1))
    assert (second.shard, second.layers, second.recurrent_layers) == (1, (3, 6), (3, 4))
    for e in (first, second):
        assert e.storage_present and e.shapes_ok and e.checkpoint_dtype == "float32"
        assert e.slots_expected == T and e.unwritten == () and e.non_owner_writes == ()
        assert e.taps_missing == () and e.problems == () and e.ok
    assert (first.taps_expected, second.taps_expected) == ((1,), (4,))


def test_reset_forgets_the_verdict_and_the_evidence() -> None:
    ok, gate, shards = judged(lambda s: s[0].pool.checkpoints[0, :, 0].fill_(math.nan))
    assert not ok and gate.report.verdict == "refused" and not gate.pending
    gate.reset()
    # the cast: mypy would keep the verdict narrowed by the assert above across reset()
    assert cast(str, gate.report.verdict) == "not_run" and gate.report.storage_generation == 1
    assert gate.report.requested and gate.pending and gate.report.shards == ()
    assert gate.judge(shards, T, TAPS, (1, 4)) is False  # reset disarms
    gate.reset()
    assert gate.report.storage_generation == 2
    run_verify(gate, shards)
    assert gate.judge(shards, T, TAPS, (1, 4))


def test_reset_between_arm_and_judge_discards_the_evidence() -> None:
    gate = CaptureGate(requested=True, tolerance=1e-4)
    shards = two_shards()
    run_verify(gate, shards)
    gate.reset()  # storage rebuilt mid-verify: this verify's evidence is void
    assert gate.judge(shards, T, TAPS, (1, 4)) is False
    assert gate.report.verdict == "not_run" and gate.report.shards == ()


def test_rearming_discards_an_aborted_verify() -> None:
    """A verify that failed before judge() leaves canaries behind; the next arm starts over."""
    gate = CaptureGate(requested=True, tolerance=1e-4)
    shards = two_shards()
    gate.arm(shards)
    shards[1].pool.checkpoints[0, :, 0] = 5.0  # a non-owner write, then the verify aborts
    gate.after_shard(0, shards)
    run_verify(gate, shards)  # arm again, clean verify
    assert gate.judge(shards, T, TAPS, (1, 4)) is True


def test_a_malformed_state_shape_is_a_programming_error() -> None:
    """ShardStorage is built by the engine with a 4-d state shape; any other is misuse and
    raises instead of comparing a truncated shape."""
    gate = CaptureGate(requested=True, tolerance=1e-4)
    shards = [ShardStorage(**{**two_shards()[0].__dict__, "state_shape": (B, HV, K)})]
    run_verify(gate, shards)
    with pytest.raises(ValueError, match=r"state_shape \[B, HV, K, V\]"):
        gate.judge(shards, T, {}, ())


# -- each refusal ---------------------------------------------------------------------------


def refusal(tamper: Any, **kwargs: Any) -> tuple[str, Any]:
    ok, gate, _ = judged(tamper, **kwargs)
    assert ok is False and gate.report.verdict == "refused" and not gate.validated
    assert not gate.pending and len(gate.report.shards) == 2
    return gate.report.reason or "", gate.report.shards


def test_missing_storage() -> None:
    reason, ev = refusal(lambda s: setattr(s[1].pool, "checkpoints", torch.empty(0)))
    assert reason == "shard 1: capture storage missing (checkpoints)"
    assert not ev[1].storage_present and ev[1].checkpoint_dtype is None and ev[0].ok
    reason, ev = refusal(lambda s: setattr(s[0].pool, "captured", None))
    assert reason.startswith("shard 0: capture storage missing") and not ev[0].storage_present


def test_a_shard_without_recurrent_layers_needs_no_storage() -> None:
    gate = CaptureGate(requested=True, tolerance=1e-4)
    empty = pool(())
    empty.checkpoints, empty.captured = torch.empty(0), torch.empty(0)
    shards = [shard(0, (0, 3), (0, 1)), shard(1, (3, 6), (), empty)]
    run_verify(gate, shards)
    assert gate.judge(shards, T, {1: torch.ones(1)}, (1,))
    assert gate.report.shards[1].storage_present


def test_one_element_storage_is_storage() -> None:
    """The smallest legal storage (one layer, one slot, 1x1 state, kernel 1: no conv rows
    before the slots) holds one element per tensor and is present, not missing."""
    # a stand-in RecurrentPool (Any, as in shard()): the gate reads only these fields
    p: Any = SimpleNamespace(layer_ids=(0,), verified_layers=(0,), live_slot=None, conv_kernel=1,
                        checkpoints=torch.zeros(1, 1, 1, 1, 1, 1), captured=torch.zeros(1, 1, 1, 1),
                        state=torch.zeros(1, 1, 1, 1, 1), conv=torch.zeros(1, 1, 0, 1))
    s = ShardStorage(index=0, device="cpu", layers=(0, 1), owned_recurrent=(0,), pool=p,
                     state_shape=(1, 1, 1, 1), conv_rows_shape=(1, 0, 1))
    gate = CaptureGate(requested=True, tolerance=1e-4)
    gate.arm([s])
    p.checkpoints.fill_(1.0)
    p.captured.fill_(1.0)
    gate.after_shard(0, [s])
    assert gate.judge([s], 1, {}, ()), gate.report.reason
    assert gate.report.shards[0].storage_present


def test_wrong_dtype() -> None:
    reason, ev = refusal(lambda s: setattr(s[0].pool, "checkpoints",
                                           s[0].pool.checkpoints.double()))
    assert reason == "shard 0: checkpoints must be float32 (got float64)"
    assert ev[0].checkpoint_dtype == "float64"


def test_layer_ownership_and_run_record() -> None:
    reason, _ = refusal(lambda s: setattr(s[1].pool, "layer_ids", (3,)))
    assert reason == "shard 1: pool holds recurrent layers [3] but the shard owns [3, 4]"
    reason, _ = refusal(lambda s: setattr(s[0].pool, "verified_layers", (0,)))
    assert reason == "shard 0: the pool reports the verify wrote layers [0], the shard owns [0, 1]"
    ok, _, _ = judged(lambda s: setattr(s[0].pool, "verified_layers", None))
    assert ok  # a pool without a run record is judged on its storage alone


@pytest.mark.parametrize(("tamper", "message"), [
    (lambda s: setattr(s[0].pool, "checkpoints", s[0].pool.checkpoints[0]),
     "checkpoints shape (1, 4, 1, 2, 2) does not match (2, 1, None, 1, 2, 2) (None: slots)"),
    (lambda s: setattr(s[0].pool, "checkpoints", s[0].pool.checkpoints[:, :, :, :, :1]),
     "checkpoints shape (2, 1, 4, 1, 1, 2) does not match (2, 1, None, 1, 2, 2) (None: slots)"),
    (lambda s: setattr(s[0].pool, "checkpoints", s[0].pool.checkpoints[:1]),
     "checkpoints shape (1, 1, 4, 1, 2, 2) does not match (2, 1, None, 1, 2, 2) (None: slots)"),
    (lambda s: setattr(s[0].pool, "checkpoints", s[0].pool.checkpoints[:, :, :2]),
     "checkpoints holds 2 slots, the verify needs 3"),
    (lambda s: setattr(s[0].pool, "captured", s[0].pool.captured[0]),
     "captured shape (1, 6, 3) does not match (2, 1, None, 3) (None: slots)"),
    (lambda s: setattr(s[0].pool, "captured", s[0].pool.captured[:1]),
     "captured shape (1, 1, 6, 3) does not match (2, 1, None, 3) (None: slots)"),
    (lambda s: setattr(s[0].pool, "captured", s[0].pool.captured[:, :, :, :2]),
     "captured shape (2, 1, 6, 2) does not match (2, 1, None, 3) (None: slots)"),
    (lambda s: setattr(s[0].pool, "captured", s[0].pool.captured[:, :, :4]),
     "captured holds 4 rows, the verify needs 5"),
])
def test_wrong_shapes(tamper: Any, message: str) -> None:
    reason, ev = refusal(tamper)
    assert reason == f"shard 0: {message}" and not ev[0].shapes_ok and ev[0].unwritten == ()


def test_exact_sizes_pass() -> None:
    def exact(s: list[ShardStorage]) -> None:
        s[0].pool.checkpoints = s[0].pool.checkpoints[:, :, :T]  # exactly T slots
        s[0].pool.captured = s[0].pool.captured[:, :, : KC - 1 + T]  # exactly Kc-1+T rows

    ok, gate, _ = judged(exact)
    assert ok and gate.report.shards[0].shapes_ok


@pytest.mark.parametrize(("tamper", "first", "count"), [
    (lambda s: s[1].pool.checkpoints[1, :, 2].fill_(math.nan), "layer 4 slot 2", 1),
    (lambda s: s[0].pool.checkpoints[0, :, 0, 0, 1, 1].fill_(math.nan), "layer 0 slot 0", 1),
    (lambda s: s[0].pool.captured[1, :, 4].fill_(math.nan), "layer 1 captured row 4", 1),
    (lambda s: s[0].pool.captured[0, :, 0].fill_(math.nan), "layer 0 captured row 0", 1),
    (lambda s: s[1].pool.checkpoints[0, :, 1:].fill_(math.nan), "layer 3 slot 1", 2),
])
def test_unwritten_entries(tamper: Any, first: str, count: int) -> None:
    reason, ev = refusal(tamper)
    shard_index = 1 if "layer 3" in first or "layer 4" in first else 0
    assert reason == f"shard {shard_index}: {count} owned entries unwritten, first {first}"
    assert ev[shard_index].unwritten[0] == first and len(ev[shard_index].unwritten) == count


def test_unwritten_list_is_capped_at_16() -> None:
    def erase(s: list[ShardStorage]) -> None:
        s[0].pool.checkpoints[:, :, :T] = math.nan
        s[0].pool.captured[:, :, : KC - 1 + T] = math.nan

    reason, ev = refusal(erase)
    assert reason == "shard 0: 16 owned entries unwritten, first layer 0 slot 0"
    assert len(ev[0].unwritten) == 16 and ev[0].unwritten[-1] == "layer 1 captured row 4"


def test_unwritten_count_is_exact_beyond_the_cap() -> None:
    def erase(s: list[ShardStorage]) -> None:
        s[1].pool.checkpoints[:, :, :S] = math.nan
        s[1].pool.captured[:, :, : KC - 1 + S] = math.nan

    ok, gate, _ = judged(erase, n=S)  # 2 layers x (4 slots + 6 rows) = 20 entries
    assert ok is False
    assert gate.report.reason == "shard 1: 20 owned entries unwritten, first layer 3 slot 0"
    assert len(gate.report.shards[1].unwritten) == 16


def test_a_slot_past_the_verify() -> None:
    reason, _ = refusal(lambda s: s[1].pool.checkpoints[1, :, T, 0, 0, 0].fill_(0.5))
    assert reason == "shard 1: layer 4: a slot past the verify's 3 was written"
    ok, _, _ = judged(lambda s: s[1].pool.captured[1, :, KC - 1 + T].fill_(0.5))
    assert ok  # captured rows past the verify are not checked


def test_non_owner_writes_are_caught_between_shards() -> None:
    gate = CaptureGate(requested=True, tolerance=1e-4)
    shards = two_shards()
    gate.arm(shards)
    write_verify(shards[0])
    shards[1].pool.checkpoints[0, :, 0, 0, 0, 0] = 2.0  # shard 0 wrote into shard 1
    shards[1].pool.captured[0, :, 0, 0] = 2.0
    gate.after_shard(0, shards)
    write_verify(shards[1], 3.0)
    gate.after_shard(1, shards)
    assert not gate.judge(shards, T, TAPS, (1, 4))
    assert gate.report.reason == ("shard 1: non-owner write: 2 entries of shard 1's storage "
                                  "written while shard 0 ran")
    assert gate.report.shards[1].non_owner_writes == (
        "2 entries of shard 1's storage written while shard 0 ran",)
    assert gate.report.shards[0].non_owner_writes == ()


def test_an_earlier_shard_changed_later_is_caught() -> None:
    gate = CaptureGate(requested=True, tolerance=1e-4)
    shards = [*two_shards(), shard(2, (6, 9), (6, 7))]
    gate.arm(shards)
    write_verify(shards[0])
    gate.after_shard(0, shards)
    write_verify(shards[1])
    gate.after_shard(1, shards)
    shards[0].pool.checkpoints[1, :, 1] += 1.0  # the third shard rewrites the first
    write_verify(shards[2])
    gate.after_shard(2, shards)
    assert not gate.judge(shards, T, {}, ())
    assert gate.report.reason == ("shard 0: non-owner write: shard 0's storage changed while "
                                  "shard 2 ran")
    assert gate.report.shards[1].non_owner_writes == ()


def test_after_shard_does_nothing_unarmed() -> None:
    gate = CaptureGate(requested=True, tolerance=1e-4)
    shards = two_shards()
    shards[1].pool.checkpoints.fill_(1.0)
    gate.after_shard(0, shards)  # not armed: no record
    run_verify(gate, shards)
    assert gate.judge(shards, T, TAPS, (1, 4))


@pytest.mark.parametrize(("taps", "expected", "message"), [
    ({1: torch.ones(2)}, (1, 4), "shard 1: tap-layer features not written for layers [4]"),
    ({1: torch.tensor([1.0, math.nan]), 4: torch.ones(2)}, (1, 4),
     "shard 0: tap-layer features not written for layers [1]"),
    ({4: torch.tensor([math.inf])}, (0, 4),
     "shard 0: tap-layer features not written for layers [0]"),
    ({0: torch.ones(1)}, (0, 3), "shard 1: tap-layer features not written for layers [3]"),
])
def test_missing_taps(taps: Any, expected: tuple[int, ...], message: str) -> None:
    reason, ev = refusal(None, taps=taps, expected=expected)
    assert reason == message
    missing = [e.taps_missing for e in ev]
    assert any(missing) and all(set(m) <= set(expected) for m in missing)


def test_taps_outside_every_shard_are_ignored() -> None:
    ok, gate, _ = judged(taps={}, expected=(6, 9))
    assert ok and [e.taps_expected for e in gate.report.shards] == [(), ()]
    ok, gate, _ = judged(taps={2: torch.ones(1), 3: torch.ones(1)}, expected=(2, 3))
    assert ok and [e.taps_expected for e in gate.report.shards] == [(2,), (3,)]


# -- the numerical self-test ----------------------------------------------------------------


def validated_gate(shards: list[ShardStorage]) -> CaptureGate:
    gate = CaptureGate(requested=True, tolerance=1e-3)
    run_verify(gate, shards)
    assert gate.judge(shards, T, TAPS, (1, 4))
    return gate


def test_save_slot_copies_the_slot_and_its_conv_window() -> None:
    shards = two_shards()
    for s in shards:
        s.pool.checkpoints.copy_(torch.arange(s.pool.checkpoints.numel()).view_as(
            s.pool.checkpoints).float())
        s.pool.captured.copy_(torch.arange(s.pool.captured.numel()).view_as(
            s.pool.captured).float())
    saved = CaptureGate.save_slot(shards, 1)
    for s, (ckpt, conv) in zip(shards, saved, strict=True):
        assert torch.equal(ckpt, s.pool.checkpoints[:, :, 1])
        assert torch.equal(conv, s.pool.captured[:, :, 2:4])  # rows slot+1 .. slot+Kc-1
        s.pool.checkpoints.zero_()
        assert ckpt.abs().sum() > 0  # a copy, not a view


def replayed(shards: list[ShardStorage], saved: Any, offset: float = 0.0) -> None:
    for s, (ckpt, conv) in zip(shards, saved, strict=True):
        s.pool.state.copy_(ckpt + offset)
        s.pool.conv.copy_(conv)


def test_self_test_passes_on_an_exact_replay() -> None:
    shards = two_shards()
    gate = validated_gate(shards)
    saved = CaptureGate.save_slot(shards, 1)
    replayed(shards, saved)
    assert gate.self_test(shards, 1, saved, step=7)
    report = gate.report
    assert report.verdict == "validated" and gate.validated and report.validated_at_step == 7
    st = report.self_test
    assert st is not None and (st.slot, st.max_abs_err, st.rel_err, st.tolerance, st.passed) == (
        1, 0.0, 0.0, 1e-3, True)
    assert len(report.shards) == 2 and not gate.pending


def test_self_test_refuses_a_differing_replay() -> None:
    shards = two_shards()
    gate = validated_gate(shards)
    saved = CaptureGate.save_slot(shards, 2)
    replayed(shards, saved, offset=0.5)  # shard 0: |1 - 1.5| / 1.5, the worst of the two
    assert not gate.self_test(shards, 2, saved, step=3)
    report = gate.report
    assert report.verdict == "refused" and not gate.validated and report.validated_at_step is None
    st = report.self_test
    assert st is not None and not st.passed and st.slot == 2
    assert st.max_abs_err == pytest.approx(0.5) and st.rel_err == pytest.approx(1 / 3)
    assert report.reason == ("numerical self-test: slot 2 differs from its replay by relative "
                             "error 0.333 > 0.001")


def test_self_test_tolerance_is_inclusive_and_nan_fails() -> None:
    shards = two_shards()
    gate = validated_gate(shards)
    saved = CaptureGate.save_slot(shards, 0)
    replayed(shards, saved, offset=0.5)
    worst = max(rel_err(ckpt, s.pool.state)[1] for s, (ckpt, _) in zip(shards, saved,
                                                                       strict=True))
    gate.tolerance = worst
    assert gate.self_test(shards, 0, saved, step=1)  # rel error == tolerance: passes
    assert gate.report.self_test is not None and gate.report.self_test.rel_err == worst
    shards2 = two_shards()
    gate2 = validated_gate(shards2)
    saved2 = CaptureGate.save_slot(shards2, 0)
    replayed(shards2, saved2)
    shards2[1].pool.conv[0, 0, 0, 0] = math.nan
    assert not gate2.self_test(shards2, 0, saved2, step=1)
    st = gate2.report.self_test
    assert st is not None and st.rel_err == math.inf and st.max_abs_err == math.inf


def test_a_refusal_while_armed_disarms() -> None:
    """A self-test refusal ends the gate even if evidence collection was under way."""
    shards = two_shards()
    gate = CaptureGate(requested=True, tolerance=1e-4)
    gate.arm(shards)
    for k, s in enumerate(shards):
        write_verify(s)
        gate.after_shard(k, shards)
    saved = CaptureGate.save_slot(shards, 0)
    replayed(shards, saved, offset=1.0)
    assert gate.self_test(shards, 0, saved, step=1) is False
    assert gate.judge(shards, T, TAPS, (1, 4)) is False
    assert gate.report.verdict == "refused"


def test_self_test_needs_one_saved_slot_per_shard() -> None:
    shards = two_shards()
    gate = validated_gate(shards)
    saved = CaptureGate.save_slot(shards, 0)
    replayed(shards, saved)
    with pytest.raises(ValueError, match="zip"):
        gate.self_test(shards, 0, saved[:1], step=1)


def test_self_test_needs_the_live_state_in_the_state_buffers() -> None:
    shards = two_shards()
    gate = validated_gate(shards)
    saved = CaptureGate.save_slot(shards, 0)
    shards[0].pool.live_slot = 0
    with pytest.raises(Exception, match="self-test needs the replayed live state"):
        gate.self_test(shards, 0, saved, step=1)


def test_rel_err() -> None:
    a, b = torch.tensor([1.0, 2.0, 5.0]), torch.tensor([1.0, 4.0, 5.0])
    m, r = rel_err(a, b)
    assert m == 2.0 and r == pytest.approx(2.0 / math.sqrt(42.0))
    assert rel_err(torch.zeros(2), torch.zeros(2)) == (0.0, 0.0)
    assert rel_err(torch.empty(0), torch.empty(0))[0] == 0.0
    m, r = rel_err(torch.ones(1), torch.zeros(1))  # zero reference: clamped, not a division
    assert m == 1.0 and r == pytest.approx(1e30)
