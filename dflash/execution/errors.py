"""Typed errors of the execution layer; each message names the field, the rule and the value."""

from __future__ import annotations


class ExecutionError(RuntimeError):
    """Base class of every error the execution layer raises on purpose."""


class LayerSplitError(ValueError):
    """A ``--devices`` / ``--layer-split`` combination that cannot form contiguous shards."""


class ShardPositionError(ExecutionError):
    """Shards disagree on the committed position; no restore may run."""


class PoisonedError(ExecutionError):
    """Verification refused: a rollback failed after it had begun changing state."""


class IllegalTransitionError(ExecutionError):
    """The execution layer was asked to move between states the specification forbids."""


class InjectedFault(ExecutionError):
    """Raised by a fault-injection hook; stands in for any failure inside a rollback."""


class RollbackConfigError(ValueError):
    """An unknown rollback mode (from the CLI, the environment or a config)."""
