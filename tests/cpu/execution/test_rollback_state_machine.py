"""Stateful property test of the execution layer (specs/rollback.md, "Property test").

Hypothesis drives the REAL :class:`SpecDecoder` on the built-in tiny model split over two
CPU shards — steps with chosen accept lengths, rollback-mode requests, storage rebuilds,
injected faults at every phase (including a failing recovery) — and compares it after
every rule with a small reference model of the specification.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from torch import Tensor

from dflash.execution import (
    ExecutionError,
    FaultInjector,
    FaultPhase,
    PoisonedError,
    RollbackMode,
    RollbackPolicy,
    RollbackStatus,
    ShardedTarget,
    SpecDecoder,
    plan_shards,
)
from dflash.model import TargetModel, greedy_generate

B = 4
PROMPT = [5, 17, 200, 3, 64]
MODEL = TargetModel.tiny_default(seed=0)
ORACLE = greedy_generate(MODEL, PROMPT, 72)  # target-only greedy continuation
FULL = PROMPT + ORACLE
FAST_PATH_PHASES = [p for p in FaultPhase if p is not FaultPhase.DURING_RECOVERY]


class ScriptedDrafter:
    """Proposes exactly ``correct`` of the target's greedy tokens, then a wrong one."""

    label = "scripted"
    tap_layers: tuple[int, ...] = ()

    def __init__(self) -> None:
        self.correct = 0

    def propose(
        self, context: list[int], last: int, block_size: int, features: Tensor | None
    ) -> list[int]:
        n = len(context)
        assert last == FULL[n]
        out = []
        for i in range(1, block_size):
            right = FULL[n + i]
            out.append(right if i <= self.correct else (right + 1) % 256)
        return out


class ScriptedFaults(FaultInjector):
    """Fires each phase in ``armed`` once, at the next step that reaches it."""

    def __init__(self) -> None:
        super().__init__()
        self.armed: set[FaultPhase] = set()

    def fire(self, phase: FaultPhase, step: int, shard: int | None = None) -> None:
        if phase in self.armed and (phase is not FaultPhase.MID_RESTORE or shard == 1):
            self.armed.discard(phase)
            self.phase = phase
            super().fire(phase, step, shard)


@dataclass
class Reference:
    """The specification in miniature: what the execution layer must report and emit."""

    mode: RollbackMode
    validated: bool = False
    poisoned: bool = False
    emitted: int = 1  # tokens of ORACLE emitted so far (the prefill's token is the first)
    pending: int = 0  # tokens of a step whose recovery failed
    counts: dict[str, int] = field(
        default_factory=lambda: {"fast": 0, "replay": 0, "replay_after_failure": 0}
    )

    @property
    def status(self) -> RollbackStatus:
        if self.poisoned:
            return RollbackStatus.POISONED
        if self.mode == "replay":
            return RollbackStatus.OFF
        return RollbackStatus.EFFECTIVE if self.validated else RollbackStatus.REQUESTED


class RollbackMachine(RuleBasedStateMachine):
    @initialize(mode=st.sampled_from(["replay", "checkpoint", "remap"]))
    def start(self, mode: RollbackMode) -> None:
        target = ShardedTarget(MODEL, plan_shards(6, "cpu,cpu", "3,3"), max_len=96, max_draft=B)
        self.drafter = ScriptedDrafter()
        self.faults = ScriptedFaults()
        self.engine = SpecDecoder(
            target, self.drafter, block_size=B, policy=RollbackPolicy(mode=mode), faults=self.faults
        )
        self.ref = Reference(mode=mode)
        self.out = [self.engine.prefill(PROMPT)]

    def room(self) -> bool:
        return self.ref.emitted + B <= len(ORACLE)

    @precondition(lambda self: self.room())
    @rule(correct=st.integers(0, B - 1))
    def step(self, correct: int) -> None:
        self._step(correct, None, False)

    @precondition(lambda self: self.room())
    @rule(
        correct=st.integers(0, B - 1),
        fault=st.sampled_from(FAST_PATH_PHASES),
        recovery_fails=st.booleans(),
    )
    def step_with_fault(self, correct: int, fault: FaultPhase, recovery_fails: bool) -> None:
        self._step(correct, fault, recovery_fails)

    def _step(self, correct: int, fault: FaultPhase | None, recovery_fails: bool) -> None:
        ref = self.ref
        self.drafter.correct = correct
        self.faults.armed = set() if fault is None else {fault}
        if fault is not None and recovery_fails:
            self.faults.armed.add(FaultPhase.DURING_RECOVERY)
        accept_n = min(correct + 1, B)
        if ref.poisoned:
            with pytest.raises(PoisonedError, match="verify refused"):
                self.engine.step()
            event("verify refused while poisoned")
            return
        effective = ref.status is RollbackStatus.EFFECTIVE
        if effective and fault is not None and recovery_fails:
            with pytest.raises(PoisonedError, match="stays poisoned"):
                self.engine.step()
            ref.poisoned, ref.pending = True, accept_n
            event("recovery failed: poisoned")
            return
        self.out += self.engine.step()
        event(f"path {self.engine.records[-1].path}, accept_n {accept_n}")
        ref.emitted += accept_n
        if not effective:
            ref.counts["replay"] += 1
            if ref.mode != "replay":
                ref.validated = True  # the gate ran on this step's verify and passed
        elif fault is not None:
            ref.counts["replay_after_failure"] += 1
            event(f"fault at {fault.value}")
        else:
            ref.counts["fast"] += 1
        assert self.engine.records[-1].accept_n == accept_n

    @precondition(lambda self: self.ref.poisoned)
    @rule()
    def resume(self) -> None:
        self.faults.armed = set()
        self.out += self.engine.resume()
        self.ref.poisoned = False
        self.ref.emitted += self.ref.pending
        self.ref.counts["replay_after_failure"] += 1

    @rule(mode=st.sampled_from(["replay", "checkpoint", "remap"]))
    def request_mode(self, mode: RollbackMode) -> None:
        if self.ref.poisoned:
            with pytest.raises(ExecutionError, match="clean target"):
                self.engine.request_mode(mode)
            return
        self.engine.request_mode(mode)
        self.ref.mode = mode

    @rule()
    def rebuild_storage(self) -> None:
        if self.ref.poisoned:
            with pytest.raises(ExecutionError, match="clean target"):
                self.engine.rebuild_storage()
            return
        self.engine.rebuild_storage()
        self.ref.validated = False

    # -- invariants -------------------------------------------------------------------------

    @invariant()
    def emitted_tokens_are_the_targets_greedy_tokens(self) -> None:
        assert self.out == ORACLE[: self.ref.emitted]

    @invariant()
    def status_matches_the_reference(self) -> None:
        assert self.engine.status is self.ref.status
        for path, n in self.ref.counts.items():
            assert self.engine.counts[path] == n, path

    @invariant()
    def fast_rollback_only_when_effective(self) -> None:
        for r in self.engine.records:
            if r.path == "fast":
                assert r.status_before is RollbackStatus.EFFECTIVE

    @invariant()
    def every_shard_at_one_position(self) -> None:
        if self.ref.poisoned:
            return
        committed = len(PROMPT) + self.ref.emitted - 1
        for kv_len, rec_len in self.engine.target.positions():
            assert kv_len in (None, committed) and rec_len in (None, committed)


RollbackMachine.TestCase.settings = settings(
    max_examples=60,
    stateful_step_count=12,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestRollbackStateMachine = RollbackMachine.TestCase
