"""Typed, JSON-serialisable results (the documented `--json` field names, plus additions)."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from dflash.execution.policy import RollbackMode, RollbackStatus


def token_sha256(tokens: Sequence[int]) -> str:
    """SHA-256 (hex) of the token ids as int32 little-endian."""
    return hashlib.sha256(np.asarray(list(tokens), dtype="<i4").tobytes()).hexdigest()


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class ShardCaptureEvidence(_Frozen):
    """What one shard's capture verify demonstrably wrote (evidence from the run itself).

    ``capture``: the per-token storage checked — ``states`` (checkpoint slots) or
    ``inputs`` (the recurrence's inputs, for ``recompute``); ``checkpoint_dtype`` is the
    dtype of its float32 buffer (``checkpoints``, or ``g``)."""

    capture: Literal["states", "inputs"] = "states"
    shard: int
    device: str
    layers: tuple[int, int]  # [first, last) layer ids the shard owns
    recurrent_layers: tuple[int, ...]  # recurrent layer ids the shard owns
    storage_present: bool
    checkpoint_dtype: str | None
    shapes_ok: bool
    slots_expected: int  # checkpoint slots per owned layer that the verify had to write
    unwritten: tuple[str, ...]  # "layer L slot s" entries still holding the NaN poison
    non_owner_writes: tuple[str, ...]  # canaries of other shards' storage that changed
    taps_expected: tuple[int, ...]
    taps_missing: tuple[int, ...]  # tap layers owned here whose features were not produced
    problems: tuple[str, ...]  # every failed check, in words

    @property
    def ok(self) -> bool:
        return not self.problems


class SelfTestReport(_Frozen):
    """The one-time numerical self-test: a checkpoint slot against a replay of the same tokens."""

    slot: int
    max_abs_err: float
    rel_err: float  # ||checkpoint - replay|| / ||replay||, recurrent state and conv rows
    tolerance: float
    passed: bool


class CaptureReport(_Frozen):
    """The capture gate's verdict. ``validated`` is sticky until storage is rebuilt."""

    requested: bool = False  # a fast mode asked for the gate
    verdict: Literal["not_run", "validated", "refused"] = "not_run"
    reason: str | None = None  # first failed check when refused
    validated_at_step: int | None = None
    storage_generation: int = 0  # bumped on every checkpoint-storage rebuild
    shards: tuple[ShardCaptureEvidence, ...] = ()
    self_test: SelfTestReport | None = None

    @property
    def validated(self) -> bool:
        return self.verdict == "validated"


class RollbackReport(_Frozen):
    """Requested mode, status reached, and how many steps rolled back through each path."""

    requested: RollbackMode
    status: RollbackStatus
    status_at_start: RollbackStatus
    #: why fast rollback could not run (capture storage that did not fit); None otherwise
    fast_unavailable_reason: str | None = None
    fast: int = 0
    replay: int = 0
    replay_after_failure: int = 0
    poison_events: int = 0


class Timings(_Frozen):
    """Wall-clock seconds (device-synchronised) of the two phases.

    ``tokens_per_s`` is the tokens the decode steps produced (all returned tokens but the
    first, which comes from the prefill's logits) over ``decode_s``; null when no decode
    step ran (``max_new_tokens`` 1, or EOS straight from the prefill).

    ``greedy_decode_s`` / ``greedy_tokens_per_s``: the plain target-only greedy baseline
    measured in the same run (same prompt, token count, shards, devices and CUDA-graph
    setting; decode after its prefill, counted the same way); null when it was not run.

    ``prefill_tokens_per_s``: the prompt tokens the prefill ran (a prefill that continued
    cached tokens counts only the new ones) over ``prefill_s``.

    With repeated runs (``--repeats``) ``decode_s`` / ``greedy_decode_s`` are the medians
    of ``decode_runs_s`` / ``greedy_decode_runs_s`` (each run's decode seconds, in the
    order they ran, alternating), and both rates come from those medians.
    """

    prefill_s: float
    decode_s: float
    tokens_per_s: float | None
    prefill_tokens_per_s: float | None = None
    greedy_decode_s: float | None = None
    greedy_tokens_per_s: float | None = None
    decode_runs_s: list[float] = Field(default_factory=list)
    greedy_decode_runs_s: list[float] = Field(default_factory=list)


class GenerationResult(_Frozen):
    """The ``dflash generate --json`` object."""

    tokens: list[int]
    sha256: str
    steps: int
    acceptance_rate: float
    avg_commit: float
    target_forwards_per_step: float
    rollback: RollbackReport
    capture: CaptureReport
    checkpoint_bytes: int
    parity: bool | None = None
    timings: Timings
    # additions beyond the documented fields
    prompt_len: int = 0
    # prompt tokens found in the caches (a continuing prefill did not run them again)
    cached_tokens: int = 0
    block_size: int = 0
    devices: list[str] = Field(default_factory=list)
    layer_split: list[int] = Field(default_factory=list)
    drafter: str = ""
    # "stop": the library's stop strings (dflash.api) cut the tokens and text
    stop_reason: Literal["max_new_tokens", "eos", "stop"] = "max_new_tokens"
    # the steps' target forwards (verifies and replays; a plain decode's one per token
    # after the first), the prefill's not counted
    target_forwards: int = 0
    effective_forwards_per_step: float | None = None  # over steps begun with status effective
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    # steps whose draft was a copy from the context (``dflash+lookup``); null for drafters
    # that never copy
    copied_drafts: int | None = None
    parity_sha256: str | None = None  # the oracle's SHA-256 when --check-parity ran
    text: str | None = None  # decoded new text (final EOS left out) when there is a tokenizer
    # checkpoint_bytes by buffer: the per-token capture of the rollback mode's kind
    # ("checkpoints", or "inputs" / "g" / "beta"), "captured" conv rows and "snapshot"
    capture_bytes: dict[str, int] = Field(default_factory=dict)
    # tree drafts: the budget (None: chains), and the slots verified per step (the chains'
    # too: the block, or the window a CPU step verified); avg_commit is the depth accepted
    tree_budget: int | None = None
    #: the sampling rule's parameters (temperature, top_k, top_p, min_p, seed); None: greedy
    sampling: dict[str, int | float] | None = None
    nodes_per_step: float | None = None
    # timings.tokens_per_s / timings.greedy_tokens_per_s; null when either is null
    speedup_vs_greedy: float | None = None
