"""The chain speculative decoding step with a fail-closed rollback.

One step, with ``committed`` tokens in the caches and ``last`` the pending token::

    d = [last, *drafter.propose(...)]            # d: [B] draft block, d[0] = last
    geometry = require_chain(parents of B slots) # validated pure chain, or no verify
    t = argmax(verify(d))                        # t[i]: the target's token after d[0..i]
    accept_n = 1 + #leading i with d[i+1] == t[i]
    emit d[1..accept_n-1] and t[accept_n-1];  commit_n = accept_n
    roll back to commit_n                         # fast (checkpoint / remap) or replay

The fast rollback runs only while the rollback status is ``effective`` (the capture gate
validated the storage and nothing is poisoned); capture storage that could not be
allocated keeps a fast mode ``requested`` and every step on replay
(``fast_unavailable_reason``).  A failure inside it after state began
to change poisons the target; the step then completes through the legacy path (restore
the pre-verify state, replay the accepted tokens) and counts as ``replay_after_failure``.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

import torch
from torch import Tensor

from dflash.execution.capture_gate import CaptureGate
from dflash.execution.errors import ExecutionError, PoisonedError, ShardPositionError
from dflash.execution.faults import NO_FAULTS, FaultInjector, FaultPhase
from dflash.execution.lifecycle import Lifecycle, Phase
from dflash.execution.policy import RollbackPolicy, RollbackStatus, parse_mode
from dflash.execution.shards import ShardedTarget, device_ids
from dflash.geometry import ChainGeometry, require_chain
from dflash.model import RecurrentPool
from dflash.model.drafters import (
    DeviceDrafter,
    Drafter,
    RevisingDrafter,
    ScoredDrafter,
    stack_tap_features,
)
from dflash.model.tiles import DEFAULT_RATE, STEP_COST, is_confidence, verify_cost


@dataclass(frozen=True)
class StepRecord:
    """One step as it happened (for results, tests and the state-machine reference)."""

    step: int
    draft: tuple[int, ...]
    accept_n: int
    emitted: tuple[int, ...]
    path: str  # "fast" | "replay" | "replay_after_failure"
    status_before: RollbackStatus
    forwards: int  # target forwards this step (verify + replays; the gate step has one more)
    failure: str | None = None


@functools.cache  # immutable once validated: every step of a generation verifies one length
def chain_of(n: int) -> ChainGeometry:
    """The validated pure chain of ``n`` slots; :func:`require_chain` raises on anything else."""
    return require_chain(tuple(range(-1, n - 1)))


def greedy_acceptance(logits: Tensor, draft: Tensor) -> tuple[Tensor, Tensor]:
    """On the device: ``logits: [B, vocab]``, ``draft: [B]`` int64 → (``t: [B]`` the
    target's greedy tokens, ``accept_n: [1]`` = 1 + #leading ``i`` with
    ``draft[i+1] == t[i]``). A chain accepts slots ``0 … accept_n-1``."""
    t = logits.argmax(-1)  # [B]
    hits = (draft[1:] == t[:-1]).to(torch.int64)  # [B-1]
    return t, 1 + torch.cumprod(hits, 0).sum(0, keepdim=True)


def leading_accepted(d: Sequence[int], t: Sequence[int]) -> int:
    """The same count on the host, from the read-back tokens (a cross-check)."""
    accept_n = 1
    while accept_n < len(d) and d[accept_n] == t[accept_n - 1]:
        accept_n += 1
    return accept_n


def self_test_tolerance(dtype: torch.dtype) -> float:
    """Relative error allowed between a checkpoint slot and its replay."""
    return 1e-4 if dtype in (torch.float32, torch.float64) else 5e-2


class SpecDecoder:
    """Greedy chain speculative decoding on a :class:`ShardedTarget`."""

    def __init__(
        self,
        target: ShardedTarget,
        drafter: Drafter,
        *,
        block_size: int = 16,
        policy: RollbackPolicy | None = None,
        faults: FaultInjector | None = None,
    ) -> None:
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 2:
            raise ValueError(f"'block_size' must be an int >= 2 (got {block_size!r})")
        if block_size > target.max_draft:
            raise ValueError(
                f"'block_size'={block_size} exceeds the checkpoint slots "
                f"max_draft={target.max_draft} the target was built with"
            )
        self.target, self.drafter, self.block_size = target, drafter, block_size
        self.policy = policy or RollbackPolicy()
        self.faults = faults or NO_FAULTS
        dtype = target.model.embed_tokens.weight.dtype
        self.gate = CaptureGate(requested=self.policy.fast, tolerance=self_test_tolerance(dtype))
        self.life = Lifecycle()
        self.taps = tuple(drafter.tap_layers)
        self.committed = 0  # tokens in every shard's caches
        self.context: list[int] = []  # those tokens
        self.last = -1  # the pending token (chosen, not yet in the caches)
        self.features: Tensor | None = None
        self.records: list[StepRecord] = []
        self.counts = {"fast": 0, "replay": 0, "replay_after_failure": 0, "poison_events": 0}
        self.target_forwards = 0
        self.status_at_start = self.status
        self._pending: tuple[list[int], int, list[int], RollbackStatus] | None = None
        self._forwards_before = 0
        #: the drafter drafts on the device (a DeviceDrafter on a target with CUDA graphs):
        #: each step enqueues the next step's proposal and reads it with the step's tokens
        self.device_drafter: DeviceDrafter | None = None
        self._next_guesses: list[int] | None = None
        #: the host may replace the device's guesses (checked once: a runtime Protocol)
        self._revising = isinstance(drafter, RevisingDrafter)
        # a Protocol check walks the drafter's attributes: once here, not every step
        self._scored = isinstance(drafter, ScoredDrafter)
        #: (tokens committed, modelled cost in decodes) of this generation's steps
        self._rate_seen = [0.0, 0.0]

    @property
    def window_rate(self) -> float:
        """This generation's tokens committed per decode of modelled step cost
        (:func:`dflash.model.tiles.verify_cost`), :data:`~dflash.model.tiles.DEFAULT_RATE`
        weighted as two steps' worth of prior: the rate a CPU verify window is chosen at."""
        tokens, cost = self._rate_seen
        prior = 2 * STEP_COST
        return (tokens + DEFAULT_RATE * prior) / (cost + prior)

    # -- status ---------------------------------------------------------------------------

    @property
    def status(self) -> RollbackStatus:
        if self.life.poisoned:
            return RollbackStatus.POISONED
        if not self.policy.fast:
            return RollbackStatus.OFF
        if self.fast_unavailable_reason is not None:  # requested, never effective
            return RollbackStatus.REQUESTED
        return RollbackStatus.EFFECTIVE if self.gate.validated else RollbackStatus.REQUESTED

    @property
    def fast_unavailable_reason(self) -> str | None:
        """Why a fast mode cannot become effective: capture storage that could not be
        allocated (the steps roll back through replay); None when the storage is whole."""
        return self.target.fast_unavailable_reason

    # -- prefill --------------------------------------------------------------------------

    @torch.inference_mode()
    def prefill(self, prompt: Sequence[int]) -> int:
        """Run the prompt; return the first generated token (now pending)."""
        vocab = self.target.model.config.vocab_size
        if len(prompt) == 0:
            raise ValueError("'prompt' must hold at least one token (got an empty prompt)")
        for i, tok in enumerate(prompt):
            if isinstance(tok, bool) or not isinstance(tok, int) or not 0 <= tok < vocab:
                raise ValueError(
                    f"'prompt' entry {i} must be a token id in [0, {vocab}) (got {tok!r})"
                )
        self.life.move("prefill")
        self._rate_seen = [0.0, 0.0]
        logits, taps = self.target.forward(list(prompt), "prefill", 0, taps=self.taps)
        self.committed, self.context = len(prompt), list(prompt)
        self.last = int(logits[-1].argmax())
        self._set_features(taps, len(prompt))
        self.target.require_position(self.committed, what="after prefill")
        self._start_device_drafting()
        return self.last

    def _start_device_drafting(self) -> None:
        """Draft on the device when the drafter can and the target runs CUDA graphs: the
        first proposal now, from the prompt's features (eager), the rest inside the steps."""
        self._next_guesses = None
        graphs = self.target.graphs
        drafter = self.drafter
        if graphs is None or not self.taps or not isinstance(drafter, DeviceDrafter):
            self.device_drafter = None
            return
        assert self.features is not None  # set from the prefill's taps
        first = self.target.shards[0]
        with first.on_device():
            guesses = drafter.start_device(
                self.features, self.last, self.target.max_len + self.block_size, self.block_size
            )
        graphs[0].bind("draft", (id(drafter), drafter.device_buffers_version))
        self.device_drafter = drafter
        self._next_guesses = [int(g) for g in guesses.tolist()]

    def _set_features(self, taps: dict[int, Tensor], rows: int) -> None:
        if not self.taps:
            return
        first = self.target.shards[0].device
        moved = {k: v.to(first) for k, v in taps.items()}
        self.features = stack_tap_features(moved, self.taps)[:rows]

    # -- the step -------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> list[int]:
        """One speculative step; returns the emitted tokens (1 … B of them)."""
        if self.life.phase is Phase.EMPTY:
            raise ExecutionError("step() before prefill(): there is no pending token")
        if self.life.poisoned:  # verify refuses while poisoned
            self.life.move("verify")
        B, step = self.block_size, len(self.records)
        self._forwards_before = self.target_forwards
        confidence: list[float] | None = None
        if self._next_guesses is not None:  # drafted on the device by the previous step
            proposal, self._next_guesses = self._next_guesses, None
            if self._revising:  # e.g. a copy from the context instead
                revising = cast(RevisingDrafter, self.drafter)  # checked in __init__
                proposal = revising.revise(list(self.context), self.last, proposal)
        else:
            proposal = self.drafter.propose(list(self.context), self.last, B, self.features)
            if self._scored:
                scored = cast(ScoredDrafter, self.drafter)  # checked in __init__
                confidence = self._check_confidence(scored.confidence())
        guesses = self._check_proposal(proposal)
        if self.committed + B > self.target.max_len:
            raise ExecutionError(
                f"KV cache capacity exhausted: a verify of {B} tokens at position "
                f"{self.committed} needs {self.committed + B} positions, the caches hold "
                f"max_len={self.target.max_len}"
            )
        # the gate runs for a fast mode only, and only on whole capture storage
        gate_run = (
            self.policy.fast and self.gate.pending and self.fast_unavailable_reason is None
        )
        # the verify window: the whole block, or on CPU tiles the part that ends on a tile
        # boundary, cut where the drafter's guesses grow unlikely (or, without its
        # confidence, capped after a partly accepted step): a prefix of the draft, lossless;
        # the gate's step verifies the whole block
        last = (self.records[-1].accept_n, len(self.records[-1].draft)) if self.records else None
        T = B if gate_run else self.target.verify_window(
            self.committed, B, last, confidence, self.window_rate
        )
        d = [self.last, *guesses[: T - 1]]  # d: [T]
        geometry = chain_of(len(d))
        self.target.require_position(self.committed, what="before verify")
        storages = self.target.storages() if gate_run else []
        if gate_run:
            self.gate.arm(storages)
        status_before = self.status
        self.life.move("verify")
        ids = device_ids(d, self.target.shards[0].device)  # [1, T]: the verify's and the count's
        logits, taps = self.target.forward(
            ids,
            "verify",
            self.committed,
            geometry=geometry,
            taps=self.taps,
            after_shard=(lambda k: self.gate.after_shard(k, storages)) if gate_run else None,
        )  # logits: [B, vocab]
        self.target_forwards += 1
        # argmax and acceptance on the device; a fast rollback is enqueued on the device's
        # count before the step's one host synchronisation reads the tokens and the count
        t_dev, count = greedy_acceptance(logits, ids[0].to(logits.device))
        fast = status_before is RollbackStatus.EFFECTIVE  # never the gate's step
        started = self._start_fast_rollback(d, count, step) if fast else None
        drafted = self._draft_on_device(taps, count, t_dev)  # the next step's guesses
        parts = [t_dev, count] if drafted is None else [t_dev, count, drafted.to(count.device)]
        read = torch.cat(parts).tolist()
        t, accept_n = read[:T], read[T]  # t[i]: target's greedy token after d[0..i]
        if accept_n != leading_accepted(d, t):
            if fast:  # put back the pre-verify state the enqueued rollback replaced
                self._undo_enqueued()
            raise ExecutionError(f"device acceptance count {accept_n} disagrees with {t}")
        emitted = [*d[1:accept_n], t[accept_n - 1]]
        commit_n = accept_n
        self._rate_seen[0] += commit_n
        self._rate_seen[1] += verify_cost(self.committed, T)
        saved = None
        if gate_run and self.gate.judge(storages, B, taps, self.taps):
            saved = self.gate.save_slot(storages, commit_n - 1)
        if drafted is None:
            self._set_features(taps, commit_n)
        else:
            self._next_guesses = read[T + 1 :]
        self._pending = (d, commit_n, emitted, status_before)
        if saved is not None:
            path, failure = self._self_test_rollback(d, commit_n, saved, step), None
        elif fast:
            path, failure = self._finish_fast_rollback(commit_n, step, started)
        else:
            self._replay(d, commit_n)
            self.life.move("rollback")
            path, failure = "replay", None
        return self._commit(path, failure)

    def _self_test_rollback(
        self, d: list[int], commit_n: int, saved: list[tuple[Tensor, Tensor]], step: int
    ) -> str:
        """The gate step rolls back through replay and runs the one-time numerical self-test.

        The reference is the model's own ``replay`` mode over the accepted tokens, which does
        not touch the capture path.
        """
        self._replay(d, commit_n)
        self.gate.self_test(self.target.storages(), commit_n - 1, saved, step)
        self.life.move("rollback")
        return "replay"

    def _check_proposal(self, proposal: object) -> list[int]:
        vocab = self.target.model.config.vocab_size
        if not isinstance(proposal, list) or len(proposal) != self.block_size - 1:
            got = len(proposal) if isinstance(proposal, list) else type(proposal).__name__
            raise ExecutionError(
                f"drafter {self.drafter.label!r} must propose block_size-1="
                f"{self.block_size - 1} tokens (got {got})"
            )
        for i, tok in enumerate(proposal):
            if isinstance(tok, bool) or not isinstance(tok, int) or not 0 <= tok < vocab:
                raise ExecutionError(
                    f"drafter {self.drafter.label!r} proposal[{i}] must be a token id in "
                    f"[0, {vocab}) (got {tok!r})"
                )
        return proposal

    def _check_confidence(self, confidence: object) -> list[float] | None:
        """A scored drafter's probabilities: None, or ``block_size - 1`` floats in [0, 1]."""
        if confidence is None:
            return None
        if not is_confidence(confidence, self.block_size):
            raise ExecutionError(
                f"drafter {self.drafter.label!r} confidence must be None or "
                f"{self.block_size - 1} probabilities in [0, 1], one per guess "
                f"(got {confidence!r})"
            )
        return confidence

    def _commit(self, path: str, failure: str | None) -> list[int]:
        assert self._pending is not None
        d, commit_n, emitted, status_before = self._pending
        self.target.require_position(self.committed + commit_n, what="after rollback")
        self.life.move("commit")
        self.context.extend(d[:commit_n])
        self.committed += commit_n
        self.last = emitted[-1]
        forwards = self.target_forwards - self._forwards_before
        self.records.append(
            StepRecord(
                len(self.records),
                tuple(d),
                commit_n,
                tuple(emitted),
                path,
                status_before,
                forwards,
                failure,
            )
        )
        self.counts[path] += 1
        self._pending = None
        return list(emitted)

    # -- rollback paths -------------------------------------------------------------------

    def _draft_on_device(
        self, taps: dict[int, Tensor], count: Tensor, t_dev: Tensor
    ) -> Tensor | None:
        """Enqueue the device drafter's next proposal (None when not drafting on the device):
        the verify's tap rows, the accepted count and the target's tokens stay on the
        device; the drafter's step replays from the first shard's graphs."""
        drafter, graphs = self.device_drafter, self.target.graphs
        if drafter is None or graphs is None:
            return None
        first = self.target.shards[0]
        rows = stack_tap_features({k: v.to(first.device) for k, v in taps.items()}, self.taps)
        with first.on_device():
            drafter.set_device_inputs(rows, count.to(first.device), t_dev.to(first.device))
            out: Tensor = graphs[0].run_static(("draft", self.block_size, False),
                                               drafter.device_step)
        return out

    def _start_fast_rollback(
        self, d: list[int], count: Tensor, step: int
    ) -> tuple[str, bool] | None:
        """Enqueue every shard's fast rollback on the device's accepted ``count`` (faults
        fire between the shards, on the host). Returns None, or ``(failure, changed)`` when
        it failed: ``changed`` once a shard's rollback may have begun changing state."""
        changed = False
        try:
            self.faults.fire(FaultPhase.BEFORE_RESTORE, step)
            self.target.require_position(self.committed, kv_extra=len(d), what="before restore")
            for shard in self.target.shards:
                if shard.index > 0:
                    self.faults.fire(FaultPhase.MID_RESTORE, step, shard.index)
                changed = True
                self.target.enqueue_rollback(shard, self.policy.mode, count)
        except ShardPositionError:
            raise
        except Exception as exc:  # fail closed: completed through the legacy path
            return f"{type(exc).__name__}: {exc}", changed
        return None

    def _finish_fast_rollback(
        self, commit_n: int, step: int, started: tuple[str, bool] | None
    ) -> tuple[str, str | None]:
        """The host side of the enqueued rollback (mirrors, KV truncation) once
        ``commit_n`` was read back; any failure, here or while enqueueing, falls back to
        the legacy path (restore the pre-verify state, replay), poisoning first when state
        had begun to change."""
        failure, changed = started if started is not None else (None, True)
        if failure is None:
            try:
                for shard in self.target.shards:
                    self.target.finish_rollback(shard, self.policy.mode, commit_n, self.committed)
                    if shard.index == 0:
                        self.faults.fire(FaultPhase.KV_TRUNCATE, step)
                self.faults.fire(FaultPhase.AFTER_RESTORE, step)
                self.life.move("rollback")
                return "fast", None
            except ShardPositionError:
                raise
            except Exception as exc:
                failure = f"{type(exc).__name__}: {exc}"
        if changed:
            self.life.move("fail")
            self.counts["poison_events"] += 1
        self.recover_pending(failure)
        return "replay_after_failure", failure

    def _undo_enqueued(self) -> None:
        """Every shard back to its pre-verify state after an enqueued rollback that will
        not be finished (the verify stays on record, awaiting its rollback)."""
        for shard in self.target.shards:
            with shard.on_device():
                shard.caches.pool.cancel_device_rollback()

    def recover_pending(self, failure: str = "") -> None:
        """Restore the pre-verify state on every shard and replay the pending step's tokens.

        Leaves ``POISONED`` (or a failed ``VERIFIED``) for ``ROLLED_BACK``; if this raises,
        the target stays poisoned and verify keeps refusing.
        """
        if self._pending is None:
            raise ExecutionError("nothing to recover: no step is pending")
        d, commit_n, _, _ = self._pending
        try:
            self.faults.fire(FaultPhase.DURING_RECOVERY, len(self.records))
            self._replay(d, commit_n)
        except Exception as exc:
            if not self.life.poisoned:
                self.life.move("fail")
                self.counts["poison_events"] += 1
            raise PoisonedError(
                f"recovery after {failure or 'a rollback failure'} failed: "
                f"{type(exc).__name__}: {exc}; the target stays poisoned"
            ) from exc
        self.life.move("recover")

    def resume(self) -> list[int]:
        """Complete a step whose recovery failed earlier (the target is poisoned)."""
        if not self.life.poisoned:
            raise ExecutionError("resume() is only for a poisoned target")
        self.recover_pending("an earlier failed recovery")
        return self._commit("replay_after_failure", "recovered by resume()")

    def _undo_verify(self, pool: RecurrentPool) -> None:
        """Live state of ``pool`` ← its pre-verify state (whatever the rollback had done)."""
        if pool.verify_start is not None:
            pool.restore_snapshot()  # the verify has not been rolled back yet
        else:
            pool.undo_rollback(self.committed)  # it was restored or remapped already

    def _replay(self, d: list[int], commit_n: int) -> None:
        """Legacy rollback: pre-verify state on every shard, then replay ``d[0..commit_n-1]``.

        The replay is the model's own ``replay`` mode: it touches no capture storage.
        """
        for shard in self.target.shards:
            with shard.on_device():
                self._undo_verify(shard.caches.pool)
            shard.truncate_kv(self.committed)
        self.target.require_position(self.committed, what="after restoring the pre-verify state")
        self.target.replay(d[:commit_n], self.committed)
        self.target_forwards += 1

    # -- requests between steps ----------------------------------------------------------

    def request_mode(self, mode: str) -> None:
        """Ask for another rollback mode from the next step on (between steps only).

        A fast mode becomes effective only through the capture gate; a verdict already
        reached stays (sticky for the engine's lifetime, until storage is rebuilt).
        """
        if self.life.phase not in (Phase.CLEAN, Phase.EMPTY):
            raise ExecutionError(
                f"request_mode needs a clean target (phase {self.life.phase.value!r})"
            )
        new = RollbackPolicy(mode=parse_mode(mode, source="'mode'"))
        self.policy = new
        if new.fast and not self.gate.requested:
            self.gate.request()

    # -- storage --------------------------------------------------------------------------

    def rebuild_storage(self) -> None:
        """Rebuild every shard's capture storage; the capture gate forgets its verdict."""
        if self.life.phase not in (Phase.CLEAN, Phase.EMPTY):
            raise ExecutionError(
                f"rebuild_storage needs a clean target (phase {self.life.phase.value!r})"
            )
        self.life.move("rebuild")
        self.target.rebuild_storage()
        self.gate.reset()
