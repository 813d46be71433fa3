"""Fault injection at every rollback phase (test hooks; inert unless armed).

Phases, in the order a fast rollback passes them:

- ``before_restore`` — after verify, before any rollback write (nothing changed yet);
- ``mid_restore`` — between two shards' restores (shard ``k >= 1`` about to restore, the
  shards before it already restored: state is half old, half new);
- ``kv_truncate`` — after the first shard's KV cache was truncated;
- ``after_restore`` — every shard restored and truncated, the step not yet committed;
- ``during_recovery`` — inside the fallback (pre-verify restore + replay) itself.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from dflash.execution.errors import InjectedFault


class FaultPhase(str, enum.Enum):
    BEFORE_RESTORE = "before_restore"
    MID_RESTORE = "mid_restore"
    KV_TRUNCATE = "kv_truncate"
    AFTER_RESTORE = "after_restore"
    DURING_RECOVERY = "during_recovery"  # the fallback itself fails: the target stays poisoned

    @property
    def changes_state_first(self) -> bool:
        """Whether a failure here happens after the rollback began changing state."""
        return self is not FaultPhase.BEFORE_RESTORE


@dataclass
class FaultInjector:
    """Raises :class:`InjectedFault` at ``phase`` on the given steps (every step if None).

    ``shard`` restricts ``mid_restore`` to the restore of that shard index.
    """

    phase: FaultPhase | None = None
    steps: frozenset[int] | None = None
    shard: int | None = None
    fired: list[tuple[int, FaultPhase]] = field(default_factory=list)

    def fire(self, phase: FaultPhase, step: int, shard: int | None = None) -> None:
        if self.phase is not phase:
            return
        if self.steps is not None and step not in self.steps:
            return
        if self.shard is not None and shard is not None and shard != self.shard:
            return
        self.fired.append((step, phase))
        where = "" if shard is None else f" on shard {shard}"
        raise InjectedFault(f"injected fault at phase {phase.value!r}{where} in step {step}")


NO_FAULTS = FaultInjector()
