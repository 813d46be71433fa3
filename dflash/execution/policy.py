"""Rollback policy: which rollback the user asked for, and the status it has reached.

Modes:

- ``replay`` — legacy: restore the pre-verify state, replay the accepted tokens;
- ``checkpoint`` — restore checkpoint slot ``commit_n - 1`` (one kernel launch per shard);
- ``remap`` — point the live state at slot ``commit_n - 1`` (moves no bytes);
- ``recompute`` — keep no per-token state: the verify captures the recurrence's per-token
  inputs, and the rollback re-runs the gated delta rule for the accepted tokens from the
  pre-verify state (one launch per shard; a fraction of the checkpoint storage).

The fast modes are only *requested* until the capture gate has validated the storage;
until then every step rolls back through ``replay``.  The mode comes from, in
order of precedence: the CLI (``--rollback``), the environment (``DFLASH_ROLLBACK``), the
default ``checkpoint`` (fast rollback *requested*: it becomes effective only through the
capture gate; ``replay`` opts out).
"""

from __future__ import annotations

import enum
import os
from collections.abc import Mapping
from typing import Literal

from pydantic import BaseModel, ConfigDict

from dflash.execution.errors import RollbackConfigError

RollbackMode = Literal["replay", "checkpoint", "remap", "recompute"]
ROLLBACK_MODES: tuple[RollbackMode, ...] = ("replay", "checkpoint", "remap", "recompute")
ENV_VAR = "DFLASH_ROLLBACK"
DEFAULT_MODE: RollbackMode = "checkpoint"  # fast rollback requested (the gate decides)


class RollbackStatus(str, enum.Enum):
    """Where fast rollback stands; there is deliberately no "on"."""

    OFF = "off"  # replay requested: no fast rollback
    REQUESTED = "requested"  # a fast mode was asked for, the capture gate has not validated
    EFFECTIVE = "effective"  # the gate validated; steps roll back through the fast mode
    POISONED = "poisoned"  # a rollback failed mid-way; verify refuses until state is restored


def parse_mode(value: str, *, source: str) -> RollbackMode:
    """``value`` as a rollback mode, or a :class:`RollbackConfigError` naming ``source``."""
    wanted = value.strip().lower() if isinstance(value, str) else value
    for mode in ROLLBACK_MODES:
        if mode == wanted:
            return mode
    raise RollbackConfigError(
        f"{source} must be one of {', '.join(ROLLBACK_MODES)} (got {value!r})"
    )


class RollbackPolicy(BaseModel):
    """The requested rollback mode; by default ``checkpoint`` (fast rollback *requested*:
    the capture gate decides), ``RollbackPolicy(mode="replay")`` opts out."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    mode: RollbackMode = DEFAULT_MODE

    @property
    def fast(self) -> bool:
        return self.mode != "replay"

    @classmethod
    def resolve(
        cls,
        cli_mode: str | None = None,
        *,
        environ: Mapping[str, str] | None = None,
    ) -> RollbackPolicy:
        """The policy from the CLI value, else ``DFLASH_ROLLBACK``, else ``checkpoint``."""
        env = os.environ if environ is None else environ
        if cli_mode is not None:
            mode = parse_mode(cli_mode, source="--rollback")
        elif env.get(ENV_VAR):
            mode = parse_mode(env[ENV_VAR], source=f"environment variable {ENV_VAR}")
        else:
            mode = DEFAULT_MODE
        return cls(mode=mode)
