"""The execution layer's state machine (specs/rollback.md has the diagram and invariants).

``EMPTY`` --prefill--> ``CLEAN`` --verify--> ``VERIFIED`` --rollback--> ``ROLLED_BACK``
--commit--> ``CLEAN``; a rollback failure after it began changing state moves
``VERIFIED`` to ``POISONED``; only ``recover`` (pre-verify snapshot restored, accepted
tokens replayed) leaves ``POISONED``, to ``ROLLED_BACK``.
"""

from __future__ import annotations

import enum

from dflash.execution.errors import IllegalTransitionError, PoisonedError


class Phase(str, enum.Enum):
    EMPTY = "empty"  # no prompt in the caches
    CLEAN = "clean"  # caches hold exactly the committed tokens; live state matches them
    VERIFIED = "verified"  # a verify ran: KV holds B extra rows, checkpoints + snapshot written
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


class Lifecycle:
    """Holds the current :class:`Phase` and refuses every transition not in the table."""

    def __init__(self) -> None:
        self.phase = Phase.EMPTY
        self.history: list[tuple[str, Phase, Phase]] = []

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
