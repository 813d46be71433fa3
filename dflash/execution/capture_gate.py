"""The capture gate: fast rollback becomes effective only on evidence from a real run.

Before the first verify that requests capture, the gate *poisons* every shard's capture
storage with NaN: the per-token buffers of the pool's capture kind (checkpoint slots, or
the recurrence's inputs ``inputs``/``g``/``beta`` for ``recompute``) and the captured conv
rows.  During that verify it checks, between shards, that the shards still to run have
untouched (all-NaN) storage and that the shards already run keep their fingerprint — a
shard that wrote storage it does not own is caught as a changed canary.  After the verify
it checks, per shard: storage present, the float32 buffers float32, every buffer correctly
shaped, the pool's layers equal the layers the plan gave the shard (and so does the pool's
own record of the layers the verify wrote), every slot ``0..T-1`` of every buffer of every
owned layer written (finite), no slot past ``T`` written, and every owned tap layer's
features produced.  Then, once, a numerical self-test: the state a fast rollback would
give for the accepted count (the checkpoint slot, or the recurrence recomputed by the
rollback's own kernel into scratch) against the live state a replay of the same tokens
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
from dflash.model.caches import RecurrentPool, path_window_rows


def _entry(name: str) -> str:
    """How an unwritten entry of buffer ``name`` is named ("layer 4 slot 2")."""
    return {"checkpoints": "slot", "captured": "captured row"}.get(name, f"{name} slot")


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


#: the per-token buffers of each capture kind (read from the pool by name), then the
#: captured conv rows; the float32 ones; the names whose "slot" is a conv row
_BUFFERS = {"states": ("checkpoints", "captured"), "inputs": ("inputs", "g", "beta", "captured")}
_F32 = ("checkpoints", "g")


def _names(pool: RecurrentPool) -> tuple[str, ...]:
    return _BUFFERS.get(getattr(pool, "capture", "states"), _BUFFERS["states"])


def _buffers(pool: RecurrentPool) -> dict[str, Tensor | None]:
    """The pool's capture buffers by name (None: missing or empty)."""
    out: dict[str, Tensor | None] = {}
    for name in _names(pool):
        t = getattr(pool, name, None)
        out[name] = t if isinstance(t, Tensor) and t.numel() > 0 else None
    return out


def _storage(pool: RecurrentPool) -> tuple[Tensor | None, ...]:
    return tuple(_buffers(pool).values())


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
        if len(s.state_shape) != 4 or len(s.conv_rows_shape) != 3:
            raise ValueError(
                f"ShardStorage needs state_shape [B, HV, K, V] and conv_rows_shape [B, Kc-1, C] "
                f"(got {s.state_shape} and {s.conv_rows_shape})"
            )
        problems: list[str] = []
        pool = s.pool
        buffers = _buffers(pool)
        present = all(t is not None for t in buffers.values())
        if not s.owned_recurrent and all(t is None for t in buffers.values()):
            present = True  # a shard without recurrent layers needs no capture storage
        if not present:
            missing_names = [name for name, t in buffers.items() if t is None]
            problems.append(f"capture storage missing ({', '.join(missing_names)})")
        f32_name = next(name for name in buffers if name in _F32)
        f32_buffer = buffers[f32_name]
        dtype = None if f32_buffer is None else str(f32_buffer.dtype).replace("torch.", "")
        for name in _F32:
            t = buffers.get(name)
            if t is not None and t.dtype != torch.float32:
                got = str(t.dtype).replace("torch.", "")
                problems.append(f"{name} must be float32 (got {got})")
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
        kc1 = s.conv_rows_shape[1]
        batch, hv, conv_dim = s.state_shape[0], s.state_shape[1], s.conv_rows_shape[2]
        trailing = {
            "checkpoints": tuple(s.state_shape[1:]), "captured": (conv_dim,),
            "inputs": (conv_dim,), "g": (hv,), "beta": (hv,),
        }
        rows_needed = {name: kc1 + n_slots if name == "captured" else n_slots for name in buffers}
        shapes_ok = True
        for name, t in buffers.items():
            if t is None:
                continue
            want = (len(s.owned_recurrent), batch, rows_needed[name], *trailing[name])
            have = tuple(t.shape)
            if len(have) != len(want) or have[:2] != want[:2] or have[3:] != want[3:]:
                shapes_ok = False
                shown = (*want[:2], None, *want[3:])
                problems.append(f"{name} shape {have} does not match {shown} (None: slots)")
            elif have[2] < want[2]:
                shapes_ok = False
                what = "rows" if name == "captured" else "slots"
                problems.append(f"{name} holds {have[2]} {what}, the verify needs {want[2]}")
        unwritten: list[str] = []
        if present and shapes_ok:
            for name, t in buffers.items():
                if t is None:
                    continue
                need = rows_needed[name]
                # one reduction per tensor, one transfer: an [L, rows] NaN map
                nan_rows = torch.isnan(t[:, :, :need]).flatten(3).any(-1).any(1).tolist()
                past = torch.isnan(t[:, :, need:]).flatten(1).all(-1).tolist()
                for i, layer in enumerate(s.owned_recurrent):
                    unwritten += [
                        f"layer {layer} {_entry(name)} {j}"
                        for j, bad in enumerate(nan_rows[i]) if bad
                    ]
                    if not past[i] and name != "captured":
                        which = "" if name == "checkpoints" else f"{name} "
                        problems.append(
                            f"layer {layer}: a {which}slot past the verify's {n_slots} was "
                            "written"
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
            capture=getattr(pool, "capture", "states"),
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
    def save_slot(
        shards: Sequence[ShardStorage], slot: int, path: Sequence[int] | None = None
    ) -> list[tuple[Tensor, Tensor]]:
        """Per shard, the state and conv window a fast rollback to slot ``slot`` would
        restore, as new tensors (before the rollback): copies of checkpoint slot ``slot``
        and its conv rows, or (capturing inputs) the recurrence recomputed into scratch by
        the rollback's own kernel — along ``path`` for a tree (its root-to-``slot`` path; a
        chain's is ``0 … slot``)."""
        out = []
        for s in shards:
            pool = s.pool
            if getattr(pool, "capture", "states") == "inputs":
                n = slot + 1 if path is None else len(path)
                out.append(pool.recomputed_copy(n, path))
                continue
            rows = path_window_rows(range(slot + 1) if path is None else path,
                                    pool.conv_kernel - 1)
            index = torch.tensor(rows, dtype=torch.int64, device=pool.captured.device)
            out.append(
                (pool.checkpoints[:, :, slot].clone(), pool.captured.index_select(2, index))
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
