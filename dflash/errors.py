"""The error hierarchy: every error dflash raises on purpose is a :class:`DFlashError`.

One subclass per layer, so callers can catch a whole layer (``except ConfigError``) or
everything dflash refuses (``except DFlashError``) without catching bugs:

======================  ===============================================================
``GeometryError``       a draft geometry was rejected (``require_chain`` / ``require_tree``)
``KernelBoundsError``   a kernel refused its arguments on the host, before any launch
                        (shapes, dtypes, devices, ``out=``; ``RollbackBoundsError``)
``CheckpointError``     a model or drafter checkpoint cannot be loaded (one family: the
                        drafter's ``DrafterCheckpointError`` derives from it)
``ConfigError``         a model configuration dflash cannot run
``ExecutionError``      the execution layer refused an operation or a step failed
                        (shards, rollback state machine, layer split, rollback mode, caches)
``UsageError``          bad user input at the API / CLI level (arguments, prompts, drafters)
======================  ===============================================================

Compatibility: the errors that used to be ``ValueError`` s (geometry, kernel bounds,
checkpoint, config, usage) still derive from ``ValueError`` as well, so existing
``except ValueError`` code and pydantic validators keep working. Execution errors are
not ``ValueError`` s (nor ``RuntimeError`` s): their documented base is
:class:`ExecutionError`. ``LayerSplitError`` and ``RollbackConfigError`` are execution
errors that are also :class:`UsageError` s, since they reject a user's option.
Passing an argument of the wrong *type* (a list where a tensor belongs) raises the
built-in ``TypeError``: that is a programming error, not a refusal.

The ``dflash`` command maps usage, config and checkpoint errors to exit 2, failures while
decoding to exit 3 and anything else (an internal error) to exit 4.

This module imports nothing from dflash or torch, so every layer, including the
torch-free :mod:`dflash.geometry`, can import it.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dflash.geometry.reasons import Rejection, RejectReason

__all__ = [
    "CheckpointError",
    "ConfigError",
    "DFlashError",
    "ExecutionError",
    "GeometryError",
    "KernelBoundsError",
    "UsageError",
]


class DFlashError(Exception):
    """Base class of every error dflash raises on purpose (never of a bug)."""


class GeometryError(DFlashError, ValueError):
    """Raised by ``require_chain`` / ``require_tree``; carries the :class:`Rejection`."""

    def __init__(self, rejection: Rejection) -> None:
        super().__init__(f"{rejection.reason.value}: {rejection.message}")
        self.rejection = rejection

    @property
    def reason(self) -> RejectReason:
        return self.rejection.reason

    @property
    def slot(self) -> int | None:
        return self.rejection.slot


class KernelBoundsError(DFlashError, ValueError):
    """A kernel entry point refused its arguments before any launch; names the argument."""


class CheckpointError(DFlashError, ValueError):
    """A checkpoint that cannot be loaded; the message names the file or tensor."""


class ConfigError(DFlashError, ValueError):
    """A model configuration that dflash cannot run; the message names field and value."""


class ExecutionError(DFlashError):
    """Base class of every error the execution layer raises on purpose."""


#: spells a parameter's name in a message: ``repr`` for the library (``'dtype'``), a flag
#: for the command line (``--dtype``)
Namer = Callable[[str], str]
_PARAM = re.compile("\x00([A-Za-z_][A-Za-z0-9_]*)\x00")


def param(name: str) -> str:
    """``name`` marked as a parameter inside a :class:`UsageError` message (see there)."""
    return f"\x00{name}\x00"


class UsageError(DFlashError, ValueError):
    """Bad user input at the API / CLI level; the message names the option and value.

    A message that names parameters marks them with :func:`param`
    (``f"{param('dtype')} must be one of ..."``): ``str(exc)`` spells them the library's
    way (``'dtype' must be one of ...``), and :meth:`worded` lets the command line spell
    them as its flags (``exc.worded(lambda p: "--" + p.replace("_", "-"))`` gives
    ``--dtype must be one of ...``).
    """

    def __init__(self, message: str) -> None:
        self._template = message
        super().__init__(_PARAM.sub(lambda m: repr(m.group(1)), message))

    def worded(self, name: Namer) -> str:
        """The message with every marked parameter spelled by ``name``."""
        return _PARAM.sub(lambda m: name(m.group(1)), self._template)
