"""The capture gate: fast rollback becomes effective only on evidence from a real run.

Before the first verify that requests capture, the gate *poisons* every shard's capture
storage (checkpoint slots and captured conv rows) with NaN.  During that verify it checks,
between shards, that the shards still to run have untouched (all-NaN) storage and that the
shards already run keep their fingerprint — a shard that wrote storage it does not own is
caught as a changed canary.  After the verify it checks, per shard: storage present,
checkpoints float32 and correctly shaped, the pool's layers equal the layers the plan gave
the shard (and so does the pool's own record of the layers the verify wrote), every slot
``0..T-1`` of every owned layer written (finite), no slot past ``T`` written, and every
owned tap layer's features produced.  Then, once, a numerical
self-test: the checkpoint of one slot against the live state a replay of the same tokens
produces.  The verdict (validated or refused) is sticky until the storage is rebuilt.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from dflash.execution.errors import IllegalTransitionError
from dflash.execution.results import CaptureReport, SelfTestReport, ShardCaptureEvidence
from dflash.model.caches import RecurrentPool


@dataclass(frozen=True)
class ShardStorage:
    """What the gate inspects for one shard: the plan's ownership and the shard's pool."""

    index: int
    device: str
    layers: tuple[int, int]  # [first, last)
    owned_recurrent: tuple[int, ...]  # recurrent layer ids the plan gives this shard
    pool: RecurrentPool
    state_shape: tuple[int, ...]  # expected [B, HV, K, V] of one layer's state
    conv_rows_shape: tuple[int, ...]  # expected [B, Kc-1, C] of one layer's conv window


def _storage(pool: RecurrentPool) -> tuple[Tensor | None, Tensor | None]:
    ckpt = getattr(pool, "checkpoints", None)
    captured = getattr(pool, "captured", None)
    ok = isinstance(ckpt, Tensor) and ckpt.numel() > 0
    ok_c = isinstance(captured, Tensor) and captured.numel() > 0
    return (ckpt if ok else None), (captured if ok_c else None)


def _nan_count(s: ShardStorage) -> int:
    """NaN entries in the shard's capture storage."""
    return sum(int(torch.isnan(t).sum()) for t in _storage(s.pool) if t is not None)


def _fingerprint(s: ShardStorage) -> tuple[int, float]:
    """(NaN count, float64 sum of the finite entries) over the shard's capture storage."""
    total = 0.0
    for t in _storage(s.pool):
        if t is not None:
            total += float(torch.nansum(t, dtype=torch.float64))
    return _nan_count(s), total


def _numel(s: ShardStorage) -> int:
    return sum(t.numel() for t in _storage(s.pool) if t is not None)


def rel_err(a: Tensor, b: Tensor) -> tuple[float, float]:
    """(max |a-b|, ||a-b|| / ||b||) in float64."""
    diff = (a.double() - b.double()).flatten()
    ref = b.double().flatten()
    return float(diff.abs().max()) if diff.numel() else 0.0, float(
        diff.norm() / ref.norm().clamp_min(1e-30)
    )


class CaptureGate:
    """Sticky validation of the capture storage; see the module docstring."""

    def __init__(self, *, requested: bool, tolerance: float) -> None:
        self.requested = requested
        self.tolerance = tolerance
        self.report = CaptureReport(requested=requested)
        self._armed = False
        self._canaries: dict[int, tuple[int, float]] = {}
        self._non_owner: dict[int, list[str]] = {}
        self._evidence: tuple[ShardCaptureEvidence, ...] = ()

    # -- lifecycle ------------------------------------------------------------------------

    @property
    def validated(self) -> bool:
        return self.report.verdict == "validated"

    @property
    def pending(self) -> bool:
        """The next verify must collect evidence (requested, no verdict yet)."""
        return self.requested and self.report.verdict == "not_run"

    def request(self) -> None:
        """A fast mode was requested after start: the gate will run at the next verify."""
        self.requested = True
        self.report = self.report.model_copy(update={"requested": True})

    def reset(self) -> None:
        """Checkpoint storage was rebuilt: forget the verdict (the gate runs again)."""
        self.report = CaptureReport(
            requested=self.requested, storage_generation=self.report.storage_generation + 1
        )
        self._armed = False
        self._canaries, self._non_owner, self._evidence = {}, {}, ()

    def _refuse(self, reason: str, shards: tuple[ShardCaptureEvidence, ...]) -> None:
        self.report = self.report.model_copy(
            update={"verdict": "refused", "reason": reason, "shards": shards}
        )
        self._armed = False

    # -- evidence collection (around the capture verify) -----------------------------------

    def arm(self, shards: Sequence[ShardStorage]) -> None:
        """Poison every shard's capture storage with NaN before the capture verify."""
        if not self.pending:
            return
        for s in shards:
            if s.pool.live_slot is not None:  # the live state would be destroyed
                raise IllegalTransitionError(
                    "capture gate armed while the live state lies in a slot "
                    f"(live_slot={s.pool.live_slot})"
                )
            for t in _storage(s.pool):
                if t is not None:
                    t.fill_(math.nan)
        self._armed = True
        self._canaries, self._non_owner, self._evidence = {}, {}, ()

    def after_shard(self, k: int, shards: Sequence[ShardStorage]) -> None:
        """Shard ``k`` just ran its layers: later shards untouched, earlier ones unchanged."""
        if not self._armed:
            return
        for s in shards:
            if s.index > k:
                nans = _nan_count(s)
                if nans != _numel(s):
                    self._non_owner.setdefault(s.index, []).append(
                        f"{_numel(s) - nans} entries of shard {s.index}'s storage written "
                        f"while shard {k} ran"
                    )
            elif s.index < k and self._canaries.get(s.index) != _fingerprint(s):
                self._non_owner.setdefault(s.index, []).append(
                    f"shard {s.index}'s storage changed while shard {k} ran"
                )
        if any(s.index > k for s in shards):  # a later shard's run compares it
            self._canaries[k] = _fingerprint(shards[k])

    def judge(
        self,
        shards: Sequence[ShardStorage],
        n_slots: int,
        taps: Mapping[int, Tensor],
        taps_expected: Sequence[int],
    ) -> bool:
        """Check the evidence of the capture verify of ``n_slots`` slots; False = refused."""
        if not self._armed:
            return False
        self._armed = False
        evidence = tuple(self._shard_evidence(s, n_slots, taps, taps_expected) for s in shards)
        bad = [e for e in evidence if not e.ok]
        if bad:
            self._refuse(f"shard {bad[0].shard}: {bad[0].problems[0]}", evidence)
            return False
        self._evidence = evidence
        self.report = self.report.model_copy(update={"shards": evidence})
        return True

    def _shard_evidence(
        self,
        s: ShardStorage,
        n_slots: int,
        taps: Mapping[int, Tensor],
        taps_expected: Sequence[int],
    ) -> ShardCaptureEvidence:
        problems: list[str] = []
        pool = s.pool
        ckpt, captured = _storage(pool)
        present = ckpt is not None and captured is not None
        if not s.owned_recurrent and ckpt is None:
            present = True  # a shard without recurrent layers needs no checkpoint storage
        if not present:
            problems.append("capture storage missing (checkpoints or captured conv rows)")
        dtype = None if ckpt is None else str(ckpt.dtype).replace("torch.", "")
        if ckpt is not None and ckpt.dtype != torch.float32:
            problems.append(f"checkpoints must be float32 (got {dtype})")
        if tuple(pool.layer_ids) != tuple(s.owned_recurrent):
            problems.append(
                f"pool holds recurrent layers {list(pool.layer_ids)} but the shard owns "
                f"{list(s.owned_recurrent)}"
            )
        reported = getattr(pool, "verified_layers", None)  # the model's own run record
        if isinstance(reported, tuple) and reported != tuple(s.owned_recurrent):
            problems.append(
                f"the pool reports the verify wrote layers {list(reported)}, the shard owns "
                f"{list(s.owned_recurrent)}"
            )
        n_layers = len(s.owned_recurrent)
        kc1 = s.conv_rows_shape[1]
        shapes_ok = True
        if ckpt is not None:
            want = (n_layers, s.state_shape[0], None, *s.state_shape[1:])
            got = tuple(ckpt.shape)
            if len(got) != 6 or any(
                w is not None and w != g for w, g in zip(want, got, strict=True)
            ):
                shapes_ok = False
                problems.append(f"checkpoints shape {got} does not match {want} (None: slots)")
            elif got[2] < n_slots:
                shapes_ok = False
                problems.append(f"checkpoints hold {got[2]} slots, the verify needs {n_slots}")
        if captured is not None:
            want_c = (n_layers, s.conv_rows_shape[0], kc1 + n_slots, s.conv_rows_shape[2])
            got_c = tuple(captured.shape)
            if (
                len(got_c) != 4
                or got_c[:2] != want_c[:2]
                or got_c[3] != want_c[3]
                or (got_c[2] < want_c[2])
            ):
                shapes_ok = False
                problems.append(f"captured shape {got_c} does not cover {want_c}")
        unwritten: list[str] = []
        if present and shapes_ok and ckpt is not None and captured is not None:
            # one reduction per tensor, one transfer: [L, slots] / [L, rows] NaN maps
            slot_nan = torch.isnan(ckpt[:, :, :n_slots]).flatten(3).any(-1).any(1).tolist()
            row_nan = torch.isnan(captured[:, :, : kc1 + n_slots]).any(-1).any(1).tolist()
            past = torch.isnan(ckpt[:, :, n_slots:]).flatten(1).all(-1).tolist()
            for i, layer in enumerate(s.owned_recurrent):
                unwritten += [f"layer {layer} slot {j}" for j, bad in enumerate(slot_nan[i]) if bad]
                unwritten += [
                    f"layer {layer} captured row {r}" for r, bad in enumerate(row_nan[i]) if bad
                ]
                if not past[i]:
                    problems.append(
                        f"layer {layer}: a slot past the verify's {n_slots} was written"
                    )
            if unwritten:
                problems.append(f"{len(unwritten)} owned entries unwritten, first {unwritten[0]}")
        non_owner = tuple(self._non_owner.get(s.index, ()))
        if non_owner:
            problems.append(f"non-owner write: {non_owner[0]}")
        lo, hi = s.layers
        owned_taps = tuple(t for t in taps_expected if lo <= t < hi)
        missing = tuple(
            t for t in owned_taps if t not in taps or not bool(torch.isfinite(taps[t]).all())
        )
        if missing:
            problems.append(f"tap-layer features not written for layers {list(missing)}")
        return ShardCaptureEvidence(
            shard=s.index,
            device=s.device,
            layers=s.layers,
            recurrent_layers=s.owned_recurrent,
            storage_present=present,
            checkpoint_dtype=dtype,
            shapes_ok=shapes_ok,
            slots_expected=n_slots,
            unwritten=tuple(unwritten[:16]),
            non_owner_writes=non_owner,
            taps_expected=owned_taps,
            taps_missing=missing,
            problems=tuple(problems),
        )

    # -- the one-time numerical self-test --------------------------------------------------

    @staticmethod
    def save_slot(shards: Sequence[ShardStorage], slot: int) -> list[tuple[Tensor, Tensor]]:
        """Copies of checkpoint slot ``slot`` and its conv window, per shard (before rollback)."""
        out = []
        for s in shards:
            pool = s.pool
            kc = pool.conv_kernel
            out.append(
                (
                    pool.checkpoints[:, :, slot].clone(),
                    pool.captured[:, :, slot + 1 : slot + kc].clone(),
                )
            )
        return out

    def self_test(
        self,
        shards: Sequence[ShardStorage],
        slot: int,
        saved: Sequence[tuple[Tensor, Tensor]],
        step: int,
    ) -> bool:
        """Compare the saved slot with the live state a replay produced; sets the verdict."""
        worst_abs, worst_rel = 0.0, 0.0
        for s, (ckpt, conv) in zip(shards, saved, strict=True):
            pool = s.pool
            if pool.live_slot is not None:
                raise IllegalTransitionError(
                    "self-test needs the replayed live state in the state buffers "
                    f"(live_slot={pool.live_slot})"
                )
            for a, b in ((ckpt, pool.state), (conv, pool.conv)):
                if b.numel():
                    m, r = rel_err(a, b)
                    if not (math.isfinite(m) and math.isfinite(r)):
                        m = r = math.inf  # NaN/inf anywhere fails (max() would drop a NaN)
                    worst_abs, worst_rel = max(worst_abs, m), max(worst_rel, r)
        passed = worst_rel <= self.tolerance and math.isfinite(worst_rel)
        report = SelfTestReport(
            slot=slot,
            max_abs_err=worst_abs,
            rel_err=worst_rel,
            tolerance=self.tolerance,
            passed=passed,
        )
        if passed:
            self.report = self.report.model_copy(
                update={"verdict": "validated", "self_test": report, "validated_at_step": step}
            )
        else:
            self.report = self.report.model_copy(update={"self_test": report})
            self._refuse(
                f"numerical self-test: slot {slot} differs from its replay by relative error "
                f"{worst_rel:.3g} > {self.tolerance:g}",
                self.report.shards,
            )
        self._evidence = ()
        return passed
