"""Typed errors of the execution layer; each message names the field, the rule and the value.

Every class derives from :class:`dflash.errors.ExecutionError` (re-exported here), the
execution layer's member of the dflash error hierarchy.
"""

from __future__ import annotations

from dflash.errors import ExecutionError as ExecutionError  # re-exported: the layer base
from dflash.errors import UsageError


class LayerSplitError(ExecutionError, UsageError):
    """A ``--devices`` / ``--layer-split`` combination that cannot form contiguous shards."""


class ShardPositionError(ExecutionError):
    """Shards disagree on the committed position; no restore may run."""


class PoisonedError(ExecutionError):
    """Verification refused: a rollback failed after it had begun changing state."""


class IllegalTransitionError(ExecutionError):
    """The execution layer was asked to move between states the specification forbids."""


class InjectedFault(ExecutionError):
    """Raised by a fault-injection hook; stands in for any failure inside a rollback."""


class RollbackConfigError(ExecutionError, UsageError):
    """An unknown rollback mode (from the CLI, the environment or a config)."""


class ContextLengthError(ExecutionError, UsageError):
    """A prompt plus its token budget needs more positions than the model or caches hold."""


class WeightsMovedError(ExecutionError):
    """A sharded target's weights are no longer where it placed them (another device or
    dtype); the message names the parameter, where it is and where the target put it."""
