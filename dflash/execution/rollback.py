"""The one owner of a verify's rollback: the lifecycle and the fast, replay and
fail-closed paths over every shard (specs/rollback.md has the state machine).

``EMPTY`` --prefill--> ``CLEAN`` --verify--> ``VERIFIED`` --rollback--> ``ROLLED_BACK``
--commit--> ``CLEAN``; a rollback failure after it began changing state moves
``VERIFIED`` to ``POISONED``; only ``recover`` (pre-verify state restored, accepted tokens
replayed) leaves ``POISONED``, to ``ROLLED_BACK``.

The paths, after a verify of ``d`` (``T`` tokens) at ``committed``:

- **fast** (``checkpoint`` / ``remap`` / ``recompute``, only while the rollback status is
  ``effective``): :meth:`Rollback.enqueue_fast` enqueues every shard's restore (or remap,
  or recompute) on what was accepted while it is still on the device — a chain's count, or
  a tree's node and path with the K/V compaction; :meth:`Rollback.finish_fast` mirrors it
  on the host once the count (and a tree's path) was read back. A failure in either falls
  back to the legacy path, poisoning first once a shard's state may have changed
  (``replay_after_failure``).
- **replay** (legacy): every pool back to its pre-verify state
  (``RecurrentPool.restore_pre_verify``, valid whatever the rollback had done), KV cut to
  ``committed``, then the model's own ``replay`` forward over ``d[0 … commit_n-1]``.

The pools only store: which path runs, and when, is decided here.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from torch import Tensor

from dflash.execution.errors import (
    ExecutionError,
    IllegalTransitionError,
    PoisonedError,
    ShardPositionError,
)
from dflash.execution.faults import FaultInjector, FaultPhase
from dflash.execution.policy import RollbackMode
from dflash.execution.shards import ShardedTarget


class Phase(str, enum.Enum):
    EMPTY = "empty"  # no prompt in the caches
    CLEAN = "clean"  # caches hold exactly the committed tokens; live state matches them
    VERIFIED = "verified"  # a verify ran: KV holds T extra rows, checkpoints + snapshot written
    ROLLED_BACK = "rolled_back"  # caches hold committed + commit_n tokens; not yet committed
    POISONED = "poisoned"  # a rollback failed mid-way; state unknown until recovered


# event -> {from: to}
TRANSITIONS: dict[str, dict[Phase, Phase]] = {
    "prefill": {Phase.EMPTY: Phase.CLEAN, Phase.CLEAN: Phase.CLEAN},
    "verify": {Phase.CLEAN: Phase.VERIFIED},
    "rollback": {Phase.VERIFIED: Phase.ROLLED_BACK},
    "fail": {Phase.VERIFIED: Phase.POISONED, Phase.POISONED: Phase.POISONED},
    "recover": {Phase.POISONED: Phase.ROLLED_BACK, Phase.VERIFIED: Phase.ROLLED_BACK},
    "commit": {Phase.ROLLED_BACK: Phase.CLEAN},
    "rebuild": {Phase.CLEAN: Phase.CLEAN, Phase.EMPTY: Phase.EMPTY},
}


#: the transitions a :class:`Lifecycle` keeps in its history
HISTORY = 1024


class Lifecycle:
    """Holds the current :class:`Phase` and refuses every transition not in the table."""

    def __init__(self) -> None:
        self.phase = Phase.EMPTY
        #: the last :data:`HISTORY` transitions (event, from, to), newest last: a kept
        #: engine moves several times a step, so the whole record would grow without end
        self.history: deque[tuple[str, Phase, Phase]] = deque(maxlen=HISTORY)

    def move(self, event: str) -> Phase:
        table = TRANSITIONS[event]
        if self.phase not in table:
            if event == "verify" and self.phase is Phase.POISONED:
                raise PoisonedError(
                    "verify refused: the target is poisoned (a rollback failed after it began "
                    "changing state); restore the pre-verify snapshot first"
                )
            raise IllegalTransitionError(
                f"event {event!r} is not allowed in phase {self.phase.value!r} "
                f"(allowed from: {', '.join(p.value for p in table)})"
            )
        old, self.phase = self.phase, table[self.phase]
        self.history.append((event, old, self.phase))
        return self.phase

    @property
    def poisoned(self) -> bool:
        return self.phase is Phase.POISONED


@dataclass(frozen=True)
class FastStart:
    """How enqueueing a fast rollback ended: ``failure`` (None: every shard enqueued) and
    ``changed`` (a shard's rollback may have begun changing state)."""

    failure: str | None
    changed: bool


#: how a step's rollback went
RollbackPath = Literal["fast", "replay", "replay_after_failure"]


class Rollback:
    """The lifecycle of one engine's steps and the rollback paths on its target."""

    def __init__(self, target: ShardedTarget, mode: RollbackMode, faults: FaultInjector) -> None:
        self.target, self.mode, self.faults = target, mode, faults
        self.life = Lifecycle()
        self.poison_events = 0
        self.replays = 0  # replay forwards run (each one target forward)

    @property
    def poisoned(self) -> bool:
        return self.life.poisoned

    def require_clean(self, what: str) -> None:
        """Raise unless no step is under way (between steps, or before a prefill)."""
        if self.life.phase not in (Phase.CLEAN, Phase.EMPTY):
            raise ExecutionError(f"{what} needs a clean target (phase {self.life.phase.value!r})")

    def begin_step(self) -> None:
        """Raise unless a step may start: a prefill ran; a poisoned target refuses."""
        if self.life.phase is Phase.EMPTY:
            raise ExecutionError("step() before prefill(): there is no pending token")
        if self.life.poisoned:  # verify refuses while poisoned
            self.life.move("verify")

    # -- the fast path --------------------------------------------------------------------

    def enqueue_fast(
        self, committed: int, window: int, accepted: Tensor, step: int, *, tree: bool = False
    ) -> FastStart:
        """Enqueue every shard's fast rollback on what the step accepted, still on the
        device (faults fire between the shards, on the host): a chain's count ``[1]``, or
        (``tree``) a tree's node, count and padded path ``[2 + T]``."""
        changed = False
        try:
            self.faults.fire(FaultPhase.BEFORE_RESTORE, step)
            self.target.require_position(committed, kv_extra=window, what="before restore")
            for shard in self.target.shards:
                if shard.index > 0:
                    self.faults.fire(FaultPhase.MID_RESTORE, step, shard.index)
                changed = True
                if tree:
                    self.target.enqueue_tree_rollback(shard, self.mode, accepted)
                else:
                    self.target.enqueue_rollback(shard, self.mode, accepted)
        except ShardPositionError:
            raise
        except Exception as exc:  # fail closed: completed through the legacy path
            return FastStart(f"{type(exc).__name__}: {exc}", changed)
        return FastStart(None, changed)

    def finish_fast(
        self, d: Sequence[int], committed: int, commit_n: int, step: int, started: FastStart,
        path: Sequence[int] | None = None,
    ) -> tuple[RollbackPath, str | None]:
        """The host side of the enqueued rollback (mirrors, KV length) once ``commit_n`` —
        and a tree's accepted root-to-node ``path`` — was read back; any failure, here or
        while enqueueing, falls back to the legacy path (``d``: the tokens it replays),
        poisoning first when state had begun to change."""
        failure = started.failure
        if failure is None:
            try:
                for shard in self.target.shards:
                    if path is None:
                        self.target.finish_rollback(shard, self.mode, commit_n, committed)
                    else:
                        self.target.finish_tree_rollback(shard, self.mode, path, committed)
                    if shard.index == 0:
                        self.faults.fire(FaultPhase.KV_TRUNCATE, step)
                self.faults.fire(FaultPhase.AFTER_RESTORE, step)
                self.life.move("rollback")
                return "fast", None
            except ShardPositionError:
                raise
            except Exception as exc:
                failure = f"{type(exc).__name__}: {exc}"
        changed = started.failure is None or started.changed
        return self._fail_closed(d, committed, commit_n, step, failure, changed=changed)

    def _fail_closed(
        self, d: Sequence[int], committed: int, commit_n: int, step: int, failure: str,
        *, changed: bool,
    ) -> tuple[RollbackPath, str | None]:
        """A fast rollback failed: poisoned first when a shard's state may have changed,
        then completed through the legacy path (:meth:`recover`)."""
        if changed:
            self.life.move("fail")
            self.poison_events += 1
        self.recover(d, committed, commit_n, step, failure)
        return "replay_after_failure", failure

    def undo_enqueued(self) -> None:
        """Every shard back to its pre-verify state after an enqueued rollback that will not
        be finished; the step then stays ``VERIFIED`` until it is recovered."""
        for shard in self.target.shards:
            with shard.on_device():
                shard.caches.pool.restore_pre_verify()

    # -- the legacy path ------------------------------------------------------------------

    def replay(self, d: Sequence[int], committed: int, commit_n: int) -> None:
        """Every shard at its pre-verify state, then ``d[0 … commit_n-1]`` replayed (the
        model's own ``replay`` mode: it touches no capture storage); ``ROLLED_BACK``."""
        self._replay(d, committed, commit_n)
        self.life.move("rollback")

    def _replay(self, d: Sequence[int], committed: int, commit_n: int) -> None:
        for shard in self.target.shards:
            with shard.on_device():
                shard.caches.pool.restore_pre_verify()
            shard.truncate_kv(committed)
        self.target.require_position(committed, what="after restoring the pre-verify state")
        self.target.replay(d[:commit_n], committed)
        self.replays += 1

    def recover(
        self, d: Sequence[int], committed: int, commit_n: int, step: int, failure: str
    ) -> None:
        """The legacy path after a failure: leaves ``POISONED`` (or a failed ``VERIFIED``)
        for ``ROLLED_BACK``; if it raises, the target stays poisoned and verify refuses."""
        try:
            self.faults.fire(FaultPhase.DURING_RECOVERY, step)
            self._replay(d, committed, commit_n)
        except Exception as exc:
            if not self.life.poisoned:
                self.life.move("fail")
                self.poison_events += 1
            raise PoisonedError(
                f"recovery after {failure or 'a rollback failure'} failed: "
                f"{type(exc).__name__}: {exc}; the target stays poisoned"
            ) from exc
        self.life.move("recover")
