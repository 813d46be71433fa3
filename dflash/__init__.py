"""dflash: lossless speculative decoding for hybrid recurrent/attention models.

The verification path is guarded in two layers: :mod:`dflash.geometry` rejects every
malformed draft geometry before any kernel runs, and :mod:`dflash.execution` enables
fast recurrent-state rollback only after capture validation has succeeded, falling
back fail-closed to snapshot + replay otherwise.

The library API (:mod:`dflash.api`)::

    import dflash
    llm = dflash.load()                    # the embedded default pair, on the CPU
    result = llm.generate("def add(a, b):", max_new_tokens=32)

``load``, ``LLM`` and ``GenerationResult`` are imported on first use (``import dflash``
stays light: no torch); the error classes come with the package.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from dflash.errors import DFlashError, UsageError

if TYPE_CHECKING:
    from dflash.api import LLM, load
    from dflash.execution.results import GenerationResult

__version__ = "0.1.0"

__all__ = [
    "LLM",
    "DFlashError",
    "GenerationResult",
    "UsageError",
    "load",
]

_LAZY = {
    "LLM": "dflash.api",
    "load": "dflash.api",
    "GenerationResult": "dflash.execution.results",
}


def __getattr__(name: str) -> Any:
    """The library API's names, imported when first asked for."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'dflash' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
