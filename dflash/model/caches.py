"""Caches for one shard (a contiguous set of layers on one device).

- :class:`KVCache` — keys/values of the shard's attention layers.
- :class:`RecurrentPool` — live state, conv window, F32 checkpoint slots, captured conv
  inputs and the pre-verify snapshot of the shard's recurrent layers, stacked so one
  ``rollback_restore`` launch restores them all.
- :class:`ShardCaches` — one of each.

What a verify captures depends on the pool's ``capture`` kind, chosen from the rollback
mode (:func:`capture_kind`):

- ``"states"`` (``replay``, ``checkpoint``, ``remap``): the F32 state after every token
  (``checkpoints``) and the pre-verify state (``snapshot``, written by the verify);
- ``"inputs"`` (``recompute``): what the recurrence consumes per token — the conv outputs
  (``inputs``: q | k | v) and the gates (``g``, ``beta``) — and nothing per token of the
  state: a rollback re-runs the gated delta rule for the accepted tokens (a tree: along
  the accepted path) from the live state, which a verify only reads, and writes
  ``snapshot`` (the pre-verify state, for the fail-closed path) in the same launch. A pool
  built for trees also holds ``tree_states``, one layer's ``[B, S, HV, K, V]`` scratch
  shared by every layer: a tree verify keeps there, layer after layer, the states of the
  nodes whose later children start from them (``gdn_verify``'s ``tree_states``).

Both capture the conv input rows (``captured``), from which a rollback takes the window.

Where the live recurrent state is (``RecurrentPool.live_slot`` on the host, mirrored
on the device by ``RecurrentPool.live``, which the kernels read):

=====================  =========================  ==========================
``live_slot``          live state of layer ``l``  live conv window
=====================  =========================  ==========================
``None`` (``live=-1``) ``state[l]``               ``conv[l]``
``j`` (after a remap)  ``checkpoints[l, :, j]``   ``conv[l]`` (the remap copies
                                                  its ``Kc-1`` rows there)
=====================  =========================  ==========================

A remap moves no recurrent state (the large part: ``HV·K·V`` floats per layer); it copies
the ``Kc-1`` conv rows of the accepted window home, so the conv window is always
``conv[l]`` and only the state's location depends on the slot. A verify reads the slot
on the device, so one CUDA graph of it (and of the rollback) serves every slot; a decode
or replay after a remap first moves the live states home (``move_live_home``: outside
any graph, before its device work) and never reads the slot.

The record of the last verify is one :class:`VerifyRecord` (``RecurrentPool.verify``),
whose ``stage`` is the pool's whole rollback state: ``"open"`` (the verify ran, the live
state is still the pre-verify one), ``"enqueued"`` (a rollback on the device's accepted
count was enqueued: ``mark_device_rollback``, then ``rollback_on_device``, device work
only, capture-safe), ``"rolled"`` (``finish_rollback`` mirrored it on the host once the
count was read back) or ``"restored"`` (``restore_pre_verify`` put the pre-verify state
back). A forward refuses while a verify is ``open`` or ``enqueued``; the next forward
drops the record. Which rollback runs, and when, is the execution layer's decision
(``dflash.execution.rollback``); the pool offers the storage, its views and the one way
back, ``restore_pre_verify``, valid at every stage.
"""

from __future__ import annotations

import array
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from dflash.errors import ExecutionError
from dflash.geometry import TreeGeometry
from dflash.kernels import gdn_recompute, rollback_restore
from dflash.kernels.checks import Backend
from dflash.kernels.tree_paths import tree_path_rows, tree_table_size, tree_table_values
from dflash.model.config import HybridConfig
from dflash.model.layers import rotary_table
from dflash.model.tree_device import compact_kv_device, conv_window_rows_device

#: what a verify captures per token: the states (``checkpoint``, ``remap``, ``replay``) or
#: the recurrence's inputs (``recompute``); see the module docstring
CaptureKind = Literal["states", "inputs"]

#: the rollback mode that needs each capture kind (every other mode captures states)
_INPUT_MODES = ("recompute",)


#: how messages name each kind's capture storage
_STORAGE_NAMES: dict[CaptureKind, str] = {
    "states": "checkpoint storage", "inputs": "recompute input storage",
}


def capture_kind(mode: str) -> CaptureKind:
    """The capture a rollback ``mode`` needs: ``"inputs"`` for ``recompute``, else ``"states"``."""
    return "inputs" if mode in _INPUT_MODES else "states"


#: lower-case phrases of allocation failures that torch reports as a plain RuntimeError:
#: its CPU allocator ("DefaultCPUAllocator: can't allocate memory" on POSIX, "…: not
#: enough memory" on Windows) and device errors that predate ``torch.OutOfMemoryError``
_OUT_OF_MEMORY_PHRASES = ("can't allocate memory", "not enough memory", "out of memory")


def is_out_of_memory(exc: BaseException) -> bool:
    """The one rule for "an allocation failed" (caches, model building, the commands):
    ``MemoryError`` (Python's allocator), ``torch.OutOfMemoryError`` (the same class as
    ``torch.cuda.OutOfMemoryError``) or a ``RuntimeError`` whose message carries one of
    :data:`_OUT_OF_MEMORY_PHRASES` (any case)."""
    if isinstance(exc, (MemoryError, torch.OutOfMemoryError)):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(p in text for p in _OUT_OF_MEMORY_PHRASES)


def allocate_capture(
    what: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str
) -> Tensor:
    """Allocate one capture buffer (``what``: ``checkpoints`` | ``inputs`` | ``g`` | ``beta``
    | ``captured`` | ``snapshot``).

    The single allocation point of :class:`RecurrentPool`'s capture storage, so a test can
    replace it to simulate a device that cannot hold the storage.
    """
    return torch.zeros(shape, dtype=dtype, device=device)


def _allocate(
    what: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str
) -> Tensor:
    """:func:`allocate_capture`, except on the ``meta`` device (a memory estimate counts
    the shapes, :mod:`dflash.execution.memory`): there nothing is allocated, so no
    simulated failure applies."""
    if torch.device(device).type == "meta":
        return torch.zeros(shape, dtype=dtype, device=device)
    return allocate_capture(what, shape, dtype, device)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0][:200] if text else ''}"


class CaptureStorageError(ExecutionError):
    """Not even the capture storage the replay path needs fits on the pool's device."""


class CacheError(ExecutionError):
    """A cache operation that would leave the caches inconsistent; nothing was changed.

    An execution-layer error: the caches refuse an operation sequence the verify/rollback
    state machine does not allow.
    """


class NoSuchBufferError(CacheError, AttributeError):
    """A capture buffer of the other capture kind was read (e.g. ``checkpoints`` of a pool
    that captures the recurrence's inputs); an ``AttributeError`` too, so ``getattr`` with a
    default and ``hasattr`` see it as absent."""


class KVCache:
    """Keys/values ``[L, B, HKV, max_len, D]`` for the attention layers ``attn_layer_ids``."""

    def __init__(
        self,
        attn_layer_ids: tuple[int, ...],
        max_len: int,
        *,
        batch: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        if max_len <= 0:
            raise ValueError(f"'max_len' must be > 0 (got {max_len})")
        self.layer_ids = tuple(attn_layer_ids)
        self.max_len = max_len
        shape = (len(self.layer_ids), batch, num_kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.length = 0
        self._index = {layer: i for i, layer in enumerate(self.layer_ids)}

    def views(self, layer: int) -> tuple[Tensor, Tensor]:
        """``(k, v)`` storage of one layer: ``[B, HKV, max_len, D]`` each."""
        i = self._index[layer]
        return self.k[i], self.v[i]

    def truncate(self, n: int) -> None:
        """Keep the first ``n`` positions (rows past ``n`` are ignored from now on)."""
        if not 0 <= n <= self.length:
            raise CacheError(f"'n' must be in [0, length={self.length}] (got {n})")
        self.length = n

    def reset(self) -> None:
        """Empty (before a prefill)."""
        self.length = 0

    def compact(self, start: int, path: Sequence[int]) -> None:
        """After a tree verify at ``start``: the accepted path's rows ``start + path[i]``
        move to ``start + i`` and the length becomes ``start + len(path)`` (a chain's path
        ``0 … n-1`` moves nothing). ``path`` must be strictly increasing from 0 within the
        rows written; checked before anything moves."""
        if not self.layer_ids:
            return
        self._check_path(start, path)
        m = len(path)
        if list(path) != list(range(m)):
            device = self.k.device
            src = torch.tensor([start + s for s in path], dtype=torch.int64).to(device)
            dst = torch.arange(start, start + m, device=device)
            for cache in (self.k, self.v):
                cache.index_copy_(3, dst, cache.index_select(3, src))
        self.length = start + m

    def compact_on_device(self, start: Tensor, path: Tensor) -> None:
        """The device half of :meth:`compact`: rows ``start + path[i]`` moved to
        ``start + i`` with ``start`` (``[1]``) and the ``-1``-padded ``path`` still on the
        device (capture-safe; :func:`~dflash.model.tree_device.compact_kv_device`). The
        length moves with :meth:`mark_compacted` once the path is known on the host."""
        if self.layer_ids:
            compact_kv_device(self.k, self.v, start, path)

    def mark_compacted(self, start: int, path: Sequence[int]) -> None:
        """The host half of a device compaction: ``path`` checked as :meth:`compact`
        checks it, then the length ``start + len(path)`` (nothing moves here)."""
        if not self.layer_ids:
            return
        self._check_path(start, path)
        self.length = start + len(path)

    def _check_path(self, start: int, path: Sequence[int]) -> None:
        if (
            not path or path[0] != 0 or any(b <= a for a, b in itertools.pairwise(path))
            or start < 0 or start + path[-1] >= self.length
        ):
            raise CacheError(
                f"'path' {list(path)} at start {start} must rise from slot 0 within the "
                f"{self.length} rows written"
            )

    def advance(self, start: int, n: int) -> None:
        """A forward wrote rows ``start … start+n-1``; the length becomes ``start + n``.

        A cache without attention layers holds no rows and keeps length 0.
        """
        if not self.layer_ids:
            return
        if start != self.length or start + n > self.max_len:
            raise CacheError(
                f"KV rows {start}..{start + n - 1} do not continue length {self.length} "
                f"within 'max_len'={self.max_len}"
            )
        self.length = start + n


class _KindBuffer:
    """A capture buffer only one capture kind has (``checkpoints``; ``inputs``, ``g``,
    ``beta``): reading it from a pool of the other kind raises :class:`NoSuchBufferError`
    naming both; assigning replaces it (storage tests tamper with it)."""

    def __init__(self, kind: CaptureKind) -> None:
        self.kind = kind
        self.name = ""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, pool: RecurrentPool, owner: type | None = None) -> Tensor:
        got = pool._capture_buffers.get(self.name)
        if got is None:
            raise NoSuchBufferError(
                f"a pool that captures {pool.capture} has no {self.name!r} buffer (only a "
                f"pool that captures {self.kind} has)"
            )
        return got

    def __set__(self, pool: RecurrentPool, value: Tensor) -> None:
        pool._capture_buffers[self.name] = value


class RecurrentPool:
    """Recurrent storage of the layers ``rec_layer_ids`` (``L`` of them), ``S = max_draft``.

    Always: ``state [L,B,HV,K,V] f32``, ``conv [L,B,Kc-1,C]``, ``captured [L,B,Kc-1+S,C]``,
    ``snapshot [L,B,HV,K,V] f32``. With ``capture="states"``: ``checkpoints
    [L,B,S,HV,K,V] f32``; with ``capture="inputs"``: ``inputs [L,B,S,C]``, ``g [L,B,S,HV]
    f32``, ``beta [L,B,S,HV]`` (``checkpoints`` is None), and with ``trees`` the tree
    verify's scratch ``tree_states [B,S,HV,K,V] f32``. ``length`` counts the tokens
    absorbed into the live state.
    """

    def __init__(
        self,
        rec_layer_ids: tuple[int, ...],
        max_draft: int,
        *,
        batch: int,
        num_v_heads: int,
        key_dim: int,
        value_dim: int,
        conv_kernel: int,
        conv_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        capture: CaptureKind = "states",
        kernel_backend: Backend = "auto",
        trees: bool = False,
    ) -> None:
        if max_draft <= 0:
            raise ValueError(f"'max_draft' must be > 0 (got {max_draft})")
        if capture not in ("states", "inputs"):
            raise ValueError(f"'capture' must be 'states' or 'inputs' (got {capture!r})")
        self.layer_ids = tuple(rec_layer_ids)
        self.max_draft = max_draft
        self.conv_kernel = conv_kernel
        self.capture: CaptureKind = capture
        #: the recurrence kernels of the model's forwards on this device: a recompute
        #: rollback runs the same, so it computes the bits the verify computed
        self.kernel_backend: Backend = kernel_backend
        n, f32 = len(self.layer_ids), torch.float32
        state_shape = (n, batch, num_v_heads, key_dim, value_dim)
        self.state = torch.zeros(state_shape, dtype=f32, device=device)
        self.conv = torch.zeros(n, batch, conv_kernel - 1, conv_dim, dtype=dtype, device=device)
        # per layer: what the verify writes per token (name -> (shape, dtype))
        rows = ((batch, conv_kernel - 1 + max_draft, conv_dim), dtype)
        layouts: dict[str, tuple[tuple[int, ...], torch.dtype]]
        if capture == "states":
            layouts = {
                "checkpoints": ((batch, max_draft, num_v_heads, key_dim, value_dim), f32),
                "captured": rows,
            }
        else:
            gates = (batch, max_draft, num_v_heads)
            layouts = {
                "inputs": ((batch, max_draft, conv_dim), dtype),
                "g": (gates, f32),
                "beta": (gates, dtype),
                "captured": rows,
            }
        #: why fast rollback cannot run on this pool (None: full capture storage)
        self.fast_unavailable_reason: str | None = None
        buffers = self._allocate_capture(n, layouts, state_shape, device)
        self.captured: Tensor = buffers.pop("captured")
        self._capture_buffers: dict[str, Tensor] = buffers  # read through _KindBuffer
        self.snapshot = self._allocate_whole(
            "snapshot", "the pre-verify snapshot", state_shape, device,
            "neither fast nor replay rollback can run",
        )
        #: a tree verify's node-state scratch (capturing inputs, built for trees), else None
        self.tree_states: Tensor | None = None
        if capture == "inputs" and trees and self.layer_ids:
            self.tree_states = self._allocate_whole(
                "tree_states", "the tree verify's node-state scratch",
                (batch, max_draft, num_v_heads, key_dim, value_dim), device,
                "no tree can be verified on this pool",
            )
        #: the live slot on the host (None: home); ``live`` is its device copy (-1: home)
        self.live_slot: int | None = None
        self.live = torch.full((1,), -1, dtype=torch.int64, device=device)
        # the committed position: ``length`` on the host (for checks), ``position`` on the
        # device (what the kernels read); only this pool's methods and the forward that
        # advances it (``advance_device`` then ``advance``) change them
        self._length = 0
        self.position = torch.zeros(batch, dtype=torch.int64, device=device)
        self._index = {layer: i for i, layer in enumerate(self.layer_ids)}
        #: the last verify, until the next forward (None: no verify since)
        self.verify: VerifyRecord | None = None

    def _allocate_capture(
        self,
        n: int,
        layouts: dict[str, tuple[tuple[int, ...], torch.dtype]],
        state_shape: tuple[int, ...],
        device: torch.device | str,
    ) -> dict[str, Tensor]:
        """The per-token capture buffers ``[n, *shape]`` of ``layouts``; if they do not fit,
        one layer's worth shared by all layers (``shared_capture``).

        A verify writes them layer by layer; the replay path never reads them back, so with
        the shared buffers every layer's verify overwrites the previous layer's and only
        fast rollback is lost (``fast_unavailable_reason`` says why). If even the shared
        buffers do not fit, :class:`CaptureStorageError`.
        """
        self.shared_capture = False
        try:
            return {
                name: _allocate(name, (n, *shape), dtype, device)
                for name, (shape, dtype) in layouts.items()
            }
        except Exception as exc:
            if not is_out_of_memory(exc):
                raise
            per_layer = sum(
                _numel(shape) * torch.empty(0, dtype=dtype).element_size()
                for shape, dtype in layouts.values()
            )
            need = n * per_layer + _numel(state_shape) * 4  # and the snapshot
            self.fast_unavailable_reason = (
                f"{_STORAGE_NAMES[self.capture]} of {need} bytes could not be allocated on "
                f"{device}: {_first_line(exc)}"
            )
        shared = min(n, 1)
        try:
            self.shared_capture = True
            return {
                name: _allocate(name, (shared, *shape), dtype, device)
                for name, (shape, dtype) in layouts.items()
            }
        except Exception as exc:
            if not is_out_of_memory(exc):
                raise
            raise CaptureStorageError(
                f"{self.fast_unavailable_reason}; the replay path's shared verify buffers "
                f"could not be allocated either: {_first_line(exc)}"
            ) from None

    def _allocate_whole(
        self, what: str, named: str, shape: tuple[int, ...], device: torch.device | str,
        consequence: str,
    ) -> Tensor:
        """One float32 capture buffer that cannot shrink: :class:`CaptureStorageError`
        (naming it, its bytes and the ``consequence``) when it does not fit."""
        try:
            return _allocate(what, shape, torch.float32, device)
        except Exception as exc:
            if not is_out_of_memory(exc):
                raise
            raise CaptureStorageError(
                f"{named} of {_numel(shape) * 4} bytes (layers {list(self.layer_ids)}) could "
                f"not be allocated on {device}: {_first_line(exc)}; {consequence}"
            ) from None

    def capture_buffers(self) -> dict[str, Tensor]:
        """The per-token capture buffers of this pool's kind, by name (``captured`` last):
        ``checkpoints`` or ``inputs``/``g``/``beta``, each ``[L, B, slots, ...]``, and
        ``captured`` ``[L, B, Kc-1+S, C]``."""
        names = (
            ("checkpoints",) if self.capture == "states" else ("inputs", "g", "beta")
        ) + ("captured",)
        return {name: getattr(self, name) for name in names}

    checkpoints = _KindBuffer("states")
    inputs = _KindBuffer("inputs")
    g = _KindBuffer("inputs")
    beta = _KindBuffer("inputs")

    @property
    def length(self) -> int:
        """Tokens absorbed into the live state (the device copy is ``position``)."""
        return self._length

    def _move_to(self, n: int) -> None:
        self._length = n
        self.position.fill_(n)

    def _set_live(self, slot: int | None) -> None:
        self.live_slot = slot
        self.live.fill_(-1 if slot is None else slot)

    @property
    def checkpoint_bytes(self) -> int:
        """Exact bytes of the capture storage: the per-token buffers of this pool's kind
        (:meth:`capture_buffers`) and the snapshot."""
        return sum(self.capture_bytes.values())

    @property
    def capture_bytes(self) -> dict[str, int]:
        """:attr:`checkpoint_bytes` by buffer name (``tree_states`` when the pool has it)."""
        parts = {**self.capture_buffers(), "snapshot": self.snapshot}
        if self.tree_states is not None:
            parts["tree_states"] = self.tree_states
        return {name: t.numel() * t.element_size() for name, t in parts.items()}

    @property
    def verified_layers(self) -> tuple[int, ...]:
        """Layers whose checkpoints the last verify has written (run evidence)."""
        v = self.verify
        if v is None:
            return ()
        return tuple(layer for layer, ok in zip(self.layer_ids, v.written, strict=True) if ok)

    def live_views(self, layer: int) -> tuple[Tensor, Tensor]:
        """The live ``(state [B,HV,K,V], conv window [B,Kc-1,C])`` of one layer (views; the
        state's location from the host's ``live_slot``)."""
        i = self._index[layer]
        j = self.live_slot
        if j is None or self.capture == "inputs":
            return self.state[i], self.conv[i]
        return self.checkpoints[i, :, j], self.conv[i]

    def kernel_views(self, layer: int) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None]:
        """What a forward's kernels take for one layer: ``(state [B,HV,K,V], conv window
        [B,Kc-1,C], slot bank [B,S,HV,K,V], live [1])`` — home state and window, and the
        slots the live state is read from when ``live >= 0`` (read on the device). A pool
        that captures inputs never remaps: no bank, no live index (``None, None``)."""
        i = self._index[layer]
        if self.capture == "inputs":
            return self.state[i], self.conv[i], None, None
        bank = self.checkpoints[0 if self.shared_capture else i]
        return self.state[i], self.conv[i], bank, self.live

    def capture_views(self, layer: int) -> LayerCapture:
        """Where a verify of one layer writes (views): see :class:`LayerCapture`."""
        i = self._index[layer]
        j = 0 if self.shared_capture else i
        if self.capture == "states":
            return LayerCapture(
                self.captured[j], checkpoints=self.checkpoints[j], snapshot=self.snapshot[i]
            )
        return LayerCapture(
            self.captured[j], inputs=self.inputs[j], g=self.g[j], beta=self.beta[j],
            tree_states=self.tree_states,
        )

    # -- verify bookkeeping (called by TargetModel.run_layers) -----------------------------

    def begin_verify(self, start: int, n: int, parents: tuple[int, ...] | None = None) -> None:
        """Record a verify of ``n`` slots at ``start`` (host bookkeeping only: the verify
        reads the live state through :meth:`kernel_views` and leaves ``conv`` alone);
        ``parents``: the validated tree's parents (None: a chain)."""
        self.check_can_advance("verify")
        if n > self.max_draft:
            raise CacheError(f"verify of {n} slots exceeds 'max_draft'={self.max_draft}")
        self.verify = VerifyRecord(
            start, n, self.live_slot, [False] * len(self.layer_ids), parents=parents
        )

    def end_verify_layer(self, layer: int) -> None:
        assert self.verify is not None  # begin_verify ran
        self.verify.written[self._index[layer]] = True

    def end_verify(self) -> None:
        """The verify is complete; until a rollback the pool only accepts a rollback."""
        assert self.verify is not None  # begin_verify ran
        self.verify.complete = True

    def advance_device(self, n: int) -> None:
        """Device part of a prefill / decode / replay: ``position += n`` (capture-safe)."""
        self.position.add_(n)

    def move_live_home(self) -> None:
        """After a remap, copy the live states from their slot to ``state`` (one copy for
        every layer; a no-op when they are home): what a decode or replay needs, which read
        and write the home state. Host-indexed; runs before a forward's device work."""
        j = self.live_slot
        if j is None:
            return
        if self.layer_ids:
            self.state.copy_(self.checkpoints[:, :, j])
        self._set_live(None)

    def advance(self, start: int, n: int) -> None:
        """Host part: the forward absorbed ``n`` tokens from ``start`` into the live state
        (after :meth:`advance_device` ran on the device)."""
        self.check_can_advance("advance")
        if start != self._length:
            raise CacheError(
                f"recurrent tokens from {start} do not continue length {self._length}"
            )
        self._length = start + n
        self.verify = None  # the live state moved on: the pre-verify state is gone

    def adopt_live(self, other: RecurrentPool) -> None:
        """Take ``other``'s live state, conv window and length (storage rebuild)."""
        if other.layer_ids != self.layer_ids:
            raise CacheError(
                f"adopt_live: layers {list(other.layer_ids)} differ from {list(self.layer_ids)}"
            )
        other.check_can_advance("adopt_live")
        for i, layer in enumerate(other.layer_ids):
            state, conv = other.live_views(layer)
            self.state[i].copy_(state)
            self.conv[i].copy_(conv)
        self._set_live(None)
        self._move_to(other.length)

    def check_can_advance(self, mode: str) -> None:
        """Raise unless the live state may be read (no verify awaiting its rollback)."""
        v = self.verify
        if v is not None and v.stage in ("open", "enqueued"):
            raise CacheError(
                f"mode {mode!r} needs a rollback of the last verify first "
                f"(it is {v.stage}: roll back on the device, or restore_pre_verify)"
            )

    # -- rollback: the device form, then the host mirrors ------------------------------------

    def mark_device_rollback(self, mode: str) -> None:
        """The host checks of a fast ``mode`` rollback, run before
        :meth:`rollback_on_device` (nothing changes when one fails), then the record that
        one is enqueued."""
        if mode not in FAST_MODES:
            raise CacheError(f"'mode' must be one of {', '.join(FAST_MODES)} (got {mode!r})")
        if capture_kind(mode) != self.capture:
            raise CacheError(
                f"a {mode!r} rollback needs {capture_kind(mode)} capture storage; this pool "
                f"captures {self.capture} (rebuild the storage for the mode)"
            )
        if self.fast_unavailable_reason is not None:
            raise CacheError(
                f"fast rollback is unavailable ({self.fast_unavailable_reason}); "
                "use restore_pre_verify and replay"
            )
        v = self.verify
        if v is None or v.stage != "open" or not v.complete:
            raise CacheError("no completed verify to roll back to (run a verify first)")
        unwritten = [layer for layer, ok in zip(self.layer_ids, v.written, strict=True) if not ok]
        if unwritten:
            raise CacheError(
                f"the last verify did not run recurrent layers {unwritten} of this pool; "
                "their capture storage holds nothing of it (use restore_pre_verify)"
            )
        v.stage = "enqueued"

    def rollback_on_device(self, mode: str, commit_n: Tensor) -> None:
        """The device work of a ``mode`` rollback whose accepted count ``commit_n`` (int64
        ``[1]``) is still on the device, then ``position += commit_n``: ``"checkpoint"``
        restores slot ``commit_n-1``, ``"remap"`` points the live state at it, and
        ``"recompute"`` saves the live (pre-verify) state into ``snapshot`` and re-runs the
        gated delta rule over the captured inputs of tokens ``0 … commit_n-1`` — one launch
        for every layer, on the verify's kernels (``kernel_backend``). Each also takes the
        conv window from the captured rows. Capture-safe: no host value, no
        synchronisation. :meth:`mark_device_rollback` first, :meth:`finish_rollback` once
        the count has been read back."""
        if mode == "recompute":
            self._recompute(commit_n, None)
            self.live.fill_(-1)
        else:
            rows_only = mode == "remap"
            rollback_restore(
                self.state, self.conv, self.checkpoints, self.captured, commit_n,
                rows_only=rows_only,
            )
            if rows_only:
                torch.sub(commit_n, 1, out=self.live)
            else:
                self.live.fill_(-1)
        self.position.add_(commit_n)

    def rollback_tree_on_device(
        self, mode: str, best: Tensor, count: Tensor, path: Tensor
    ) -> None:
        """The device work of a ``mode`` rollback of a tree verify to its accepted node,
        known only on the device (:func:`~dflash.model.tree_device.accept_tree_device`):
        ``best`` ``[1]`` the node, ``count`` ``[1]`` its path's length, ``path`` ``[n]`` the
        ``-1``-padded root-to-node path. The twin of :meth:`rollback_path`:
        ``"checkpoint"`` copies the node's checkpoint home, ``"remap"`` points the live
        state at it, ``"recompute"`` saves the pre-verify state in ``snapshot`` and re-runs
        the gated delta rule along the path; each takes the conv window along the path;
        then ``position += count``. Capture-safe: no host value. :meth:`mark_device_rollback`
        first, :meth:`finish_tree_rollback` once the path was read back."""
        if mode == "recompute":
            self._recompute(count, path.clamp(min=0))  # padding is past count: never read
            self.live.fill_(-1)
        else:
            if self.layer_ids:
                rows = conv_window_rows_device(path, count, self.conv_kernel - 1)
                torch.index_select(self.captured, 2, rows, out=self.conv)
                if mode == "checkpoint":  # straight into the live state: no temporary
                    torch.index_select(self.checkpoints, 2, best, out=self.state.unsqueeze(2))
            if mode == "remap":
                self.live.copy_(best)
            else:
                self.live.fill_(-1)
        self.position.add_(count)

    def finish_tree_rollback(self, mode: str, path: Sequence[int]) -> None:
        """Host mirrors of an enqueued :meth:`rollback_tree_on_device`, with the accepted
        ``path`` read back: checked as a root-to-node path of the verified tree (a bad one
        raises, and the caller fails closed), then the live slot and the length."""
        v = self.verify
        if v is None or v.stage != "enqueued":
            raise CacheError("finish_tree_rollback without an enqueued device rollback")
        v.require_path(path)
        self.live_slot = path[-1] if mode == "remap" else None
        self._length = v.start + len(path)
        v.stage = "rolled"

    def rollback_path(self, mode: str, path: Sequence[int]) -> None:
        """A fast ``mode`` rollback of a verify to the accepted root-to-node ``path`` (slots;
        a tree's accepted branch, or a chain's ``0 … commit_n-1``), with the path known on
        the host: the live state becomes the checkpoint of its last slot (``checkpoint``:
        copied home; ``remap``: pointed at), or the gated delta rule re-run along the path
        from the pre-verify state (``recompute``, which first saves that state in
        ``snapshot``); the conv window the last ``Kc-1`` inputs along the path (the
        pre-verify window's rows where the path is shorter); ``length`` the verify's start
        + ``len(path)``. Every check runs first (nothing changes when one fails)."""
        self.mark_device_rollback(mode)
        v = self.verify
        assert v is not None  # mark_device_rollback checked it
        try:
            v.require_path(path)
        except CacheError:
            v.stage = "open"  # refused before any change
            raise
        u, m = path[-1], len(path)
        if mode == "recompute":
            self._recompute(m, self._path_rows(path) if self.layer_ids else None)
        elif self.layer_ids:
            rows = path_window_rows(path, self.conv_kernel - 1)
            index = torch.tensor(rows, dtype=torch.int64).to(self.conv.device)
            self.conv.copy_(self.captured.index_select(2, index))
            if mode == "checkpoint":
                self.state.copy_(self.checkpoints[:, :, u])
        self._set_live(u if mode == "remap" else None)
        self._move_to(v.start + m)
        v.stage = "rolled"

    def recomputed_copy(
        self, commit_n: int, path: Sequence[int] | None = None
    ) -> tuple[Tensor, Tensor]:
        """What a ``recompute`` rollback of ``commit_n`` tokens (a tree: along its accepted
        root-to-node ``path``, ``commit_n = len(path)``) would make the live states and
        conv windows, as new tensors ``[L,B,HV,K,V]``, ``[L,B,Kc-1,C]`` computed by the same
        kernel into scratch, the pool unchanged (the capture gate's self-test)."""
        v = self.verify
        if self.capture != "inputs":
            raise CacheError("recomputed_copy needs a pool that captures inputs")
        if v is None or v.stage != "open" or not v.complete:
            raise CacheError("recomputed_copy needs a completed verify, not yet rolled back")
        if isinstance(commit_n, bool) or not isinstance(commit_n, int) or not 1 <= commit_n <= v.n:
            raise CacheError(f"'commit_n' must be in [1, verified slots={v.n}] (got {commit_n!r})")
        if path is not None:
            v.require_path(path)
            if len(path) != commit_n:
                raise CacheError(f"'path' {list(path)} does not hold commit_n={commit_n} slots")
        elif v.parents is not None:
            raise CacheError("recomputed_copy of a tree verify needs the accepted 'path'")
        state, conv = torch.empty_like(self.state), torch.empty_like(self.conv)
        if self.layer_ids:
            gdn_recompute(
                self.state, self.inputs, self.g, self.beta, conv, self.captured, commit_n,
                out=state, path=None if path is None else self._path_rows(path),
                backend=self.kernel_backend,
            )
        return state, conv

    def _recompute(self, commit_n: int | Tensor, path: Tensor | None) -> None:
        """The enqueued ``recompute`` rollback's launch: the live state saved in
        ``snapshot`` and re-run over ``commit_n`` tokens (along ``path``), the conv window
        taken. A call the kernel refuses has changed nothing — not even ``snapshot`` — so
        the record goes back to ``open``: :meth:`restore_pre_verify` then keeps the live
        state instead of copying a stale snapshot over it."""
        if not self.layer_ids:  # a shard without recurrent layers has nothing to re-run
            return
        try:
            gdn_recompute(
                self.state, self.inputs, self.g, self.beta, self.conv, self.captured,
                commit_n, snapshot=self.snapshot, path=path, backend=self.kernel_backend,
            )
        except Exception:
            if self.verify is not None and self.verify.stage == "enqueued":
                self.verify.stage = "open"
            raise

    def _path_rows(self, path: Sequence[int]) -> Tensor:
        """A checked root-to-node ``path`` as the int64 rows tensor the recompute reads, on
        the pool's device (a host path: one small copy)."""
        return torch.tensor(list(path), dtype=torch.int64).to(self.state.device)

    def finish_rollback(self, mode: str, commit_n: int) -> None:
        """Host mirrors of an enqueued device rollback, with the count read back; a count
        outside ``1 … verified slots`` raises (the device clamped it: the state is then
        not the committed one and the caller must fail closed)."""
        v = self.verify
        if v is None or v.stage != "enqueued":
            raise CacheError("finish_rollback without an enqueued device rollback")
        if isinstance(commit_n, bool) or not isinstance(commit_n, int):
            raise CacheError(f"'commit_n' must be an int (got {commit_n!r})")
        if not 1 <= commit_n <= v.n:
            raise CacheError(f"'commit_n' must be in [1, verified slots={v.n}] (got {commit_n})")
        self.live_slot = commit_n - 1 if mode == "remap" else None
        self._length = v.start + commit_n
        v.stage = "rolled"

    def restore_pre_verify(self) -> None:
        """Live state ← the state before the last verify, whatever its rollback did
        (the fail-closed path): home, ``length`` = the verify's start; idempotent.

        Capturing states, every layer the verify reached has its pre-verify state in
        ``snapshot``; a layer it never reached (a verify that failed part-way) still holds
        it where it was (home, or the slot a remap left it in). Capturing inputs, a verify
        writes no state: the live state is the pre-verify one until a rollback is enqueued,
        which first saves it in ``snapshot``. A verify leaves ``conv`` alone; once a
        rollback was enqueued (every layer verified, whole capture storage) the pre-verify
        window is taken back from the captured rows ``0 … Kc-2``.
        """
        v = self.verify
        if v is None:
            raise CacheError("no verify to undo (restore_pre_verify needs a preceding verify)")
        if v.stage == "restored":
            return
        if self.capture == "inputs":
            if v.stage != "open":
                self.state.copy_(self.snapshot)
        elif all(v.written):
            self.state.copy_(self.snapshot)
        else:
            for i, written in enumerate(v.written):
                if written:
                    self.state[i].copy_(self.snapshot[i])
                elif v.slot_before is not None:
                    self.state[i].copy_(self.checkpoints[i, :, v.slot_before])
        if v.stage != "open" and self.layer_ids:
            self.conv.copy_(self.captured[:, :, : self.conv_kernel - 1])
        self._set_live(None)
        self._move_to(v.start)
        v.stage = "restored"

    def reset(self) -> None:
        """Empty state (before a prefill)."""
        self.state.zero_()
        self.conv.zero_()
        self._set_live(None)
        self._move_to(0)
        self.verify = None


def path_window_rows(path: Sequence[int], kc1: int) -> list[int]:
    """The captured rows (``[Kc-1+S]``: the pre-verify window, then one row per slot) that
    make the conv window after a verify's root-to-node ``path``: entries ``m … m+Kc-2`` of
    ``concat(pre-verify window, the path's slots)``, ``m = len(path)`` (a chain's
    ``0 … n-1``: rows ``n … n+Kc-2``)."""
    m = len(path)
    return [j if j < kc1 else kc1 + path[j - kc1] for j in range(m, m + kc1)]


#: the rollback modes a pool runs on the device
FAST_MODES = ("checkpoint", "remap", "recompute")


@dataclass(frozen=True)
class LayerCapture:
    """Where a verify of one recurrent layer writes (views into its pool).

    ``captured`` ``[B, Kc-1+S, C]``: the conv input rows (previous window, then the
    tokens). Capturing states: ``checkpoints`` ``[B, S, HV, K, V]`` f32 (the state after
    each token) and ``snapshot`` ``[B, HV, K, V]`` (the pre-verify state). Capturing
    inputs: ``inputs`` ``[B, S, C]`` (the conv outputs q | k | v), ``g`` ``[B, S, HV]`` f32
    and ``beta`` ``[B, S, HV]`` (the gates), and, built for trees, ``tree_states``
    ``[B, S, HV, K, V]`` f32 (the scratch a tree verify keeps reloaded node states in).
    """

    captured: Tensor
    checkpoints: Tensor | None = None
    snapshot: Tensor | None = None
    inputs: Tensor | None = None
    g: Tensor | None = None
    beta: Tensor | None = None
    tree_states: Tensor | None = None


@dataclass
class VerifyRecord:
    """The last verify of a pool: where it started, how many slots it wrote, where the live
    state was before it, which layers it wrote (``complete`` once it ran to its end), and
    its rollback's ``stage`` (the module docstring)."""

    start: int
    n: int
    slot_before: int | None
    written: list[bool]
    complete: bool = False
    stage: Literal["open", "enqueued", "rolled", "restored"] = "open"
    parents: tuple[int, ...] | None = None  # a tree verify's parents (None: a chain)

    def require_path(self, path: Sequence[int]) -> None:
        """Raise unless ``path`` is a root-to-node path of this verify's slots: ``[0]``, then
        each slot's child in the tree (a chain: ``0, 1, …``)."""
        if (
            not path or path[0] != 0 or len(path) > self.n
            or any(isinstance(s, bool) or not isinstance(s, int) for s in path)
        ):
            raise CacheError(
                f"'path' must start at the root slot 0 and hold at most {self.n} slots "
                f"(got {list(path)})"
            )
        for a, b in itertools.pairwise(path):
            parent = a + 1 == b if self.parents is None else (
                0 <= b < self.n and self.parents[b] == a
            )
            if not parent:
                raise CacheError(
                    f"'path' {list(path)} is not a root-to-node path of the verified "
                    f"{'tree' if self.parents is not None else 'chain'}: slot {b} is not a "
                    f"child of {a}"
                )


def _numel(shape: tuple[int, ...]) -> int:
    out = 1
    for d in shape:
        out *= d
    return out


class TreeTables:
    """The device tables a tree verify's kernels read, sized for ``S = max_draft`` nodes
    and refilled (host to device, outside any graph) before each tree verify, so one CUDA
    graph of the verify serves every tree of ``T`` nodes: ``depth [S]`` int64 (node ``t``
    sits at the committed position + ``depth[t]``), ``paths [S, S]`` int32 (the path
    table of :func:`dflash.kernels.tree_paths_into`; a verify reads its ``[T, T]`` corner)
    and ``parents [2S + S*S]`` int32 (:func:`dflash.kernels.tree_parents_into`'s layout,
    the recurrence's: the ``T`` parents, the ``T`` reload flags, then ``T`` walks of ``T``
    entries).

    ``parents`` and ``paths`` are views of one device buffer, staged in one pinned host
    buffer allocated once: a fill is one host-built array per table and two copies (the
    int32 block and the depths), with nothing allocated per step. Before a fill rewrites
    the staging it waits for the previous fill's copies (an event; long done by then, as
    a tree step reads back its verify's result)."""

    def __init__(self, max_draft: int, device: torch.device | str) -> None:
        S = max_draft
        device = torch.device(device)
        pinned = device.type == "cuda"
        self.depth = torch.zeros(S, dtype=torch.int64, device=device)
        self._head = tree_table_size(S)  # the recurrence's table, then the path table
        self._table = torch.full((self._head + S * S,), -1, dtype=torch.int32, device=device)
        self.parents = self._table[: self._head]
        self.paths = self._table[self._head :].view(S, S)
        self._stage = torch.full((self._head + S * S,), -1, dtype=torch.int32,
                                 pin_memory=pinned)
        self._stage_depth = torch.zeros(S, dtype=torch.int64, pin_memory=pinned)
        self._copied: torch.cuda.Event | None = None

    def fill(self, tree: TreeGeometry) -> None:
        """The tables of the validated ``tree`` (at most ``S`` nodes)."""
        T, S = tree.n_actual, self.depth.shape[0]
        if S < T:
            raise CacheError(f"a tree of {T} nodes exceeds the {S} slots")
        if self._copied is not None:  # the previous copies have read the staging
            self._copied.synchronize()
        head = tree_table_values(tree.parents)  # [2T + T*T]
        rows = tree_path_rows(tree, S)  # the first T rows, S wide
        H = self._head
        self._stage[: len(head)].copy_(torch.frombuffer(head, dtype=torch.int32))
        self._stage[H : H + T * S].copy_(torch.frombuffer(rows, dtype=torch.int32))
        depth = torch.frombuffer(array.array("q", tree.depth), dtype=torch.int64)
        self._stage_depth[:T].copy_(depth)
        n = H + T * S
        pinned = self._stage.is_pinned()
        self._table[:n].copy_(self._stage[:n], non_blocking=pinned)
        self.depth[:T].copy_(self._stage_depth[:T], non_blocking=pinned)
        if pinned:
            self._copied = torch.cuda.Event()  # type: ignore[no-untyped-call]  # torch leaves Event untyped
            self._copied.record()


class ShardCaches:
    """One :class:`KVCache` and one :class:`RecurrentPool` for a contiguous layer range,
    the rotary table ``(cos, sin)`` ``[max_len, rotary_dim]`` their attention reads, and
    the tables of a tree verify (:class:`TreeTables`)."""

    def __init__(self, kv: KVCache, pool: RecurrentPool, rope: tuple[Tensor, Tensor]) -> None:
        if rope[0].shape[0] < kv.max_len:
            raise ValueError(
                f"'rope' covers {rope[0].shape[0]} positions, the KV cache {kv.max_len}"
            )
        self.kv = kv
        self.pool = pool
        self.rope = rope
        self.tree = TreeTables(pool.max_draft, pool.position.device)

    def rotary(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """cos/sin rows ``[T, rotary_dim]`` of ``positions: [T]`` (int64 on the caches' device)."""
        cos, sin = self.rope
        return cos.index_select(0, positions), sin.index_select(0, positions)

    @classmethod
    def for_layers(
        cls,
        config: HybridConfig,
        layer_ids: tuple[int, ...] | range,
        *,
        max_len: int,
        max_draft: int,
        batch: int = 1,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        kv: KVCache | None = None,
        capture: CaptureKind = "states",
        kernel_backend: Backend = "auto",
        trees: bool = False,
    ) -> ShardCaches:
        """Caches for ``layer_ids`` of ``config`` (attention and recurrent ones split out);
        ``kv``: keep this KV cache instead of allocating one (a capture-storage rebuild);
        ``capture``: what a verify captures, ``kernel_backend``: the model's recurrence
        kernels on ``device``, ``trees``: verifies of trees (:class:`RecurrentPool`)."""
        ids = tuple(layer_ids)
        for layer in ids:
            if not 0 <= layer < config.num_hidden_layers:
                raise ValueError(
                    f"'layer_ids' entry must be in [0, {config.num_hidden_layers}) (got {layer})"
                )
        attn = tuple(i for i in ids if config.layer_types[i] == "full_attention")
        rec = tuple(i for i in ids if config.layer_types[i] == "linear_attention")
        if kv is None:
            kv = KVCache(
                attn, max_len, batch=batch, num_kv_heads=config.num_key_value_heads,
                head_dim=config.head_dim, dtype=dtype, device=device,
            )
        elif kv.layer_ids != attn or kv.max_len != max_len:
            raise CacheError(
                f"'kv' holds layers {list(kv.layer_ids)} x {kv.max_len} positions, the shard "
                f"needs {list(attn)} x {max_len}"
            )
        pool = RecurrentPool(
            rec, max_draft, batch=batch, num_v_heads=config.linear_num_value_heads,
            key_dim=config.linear_key_head_dim, value_dim=config.linear_value_head_dim,
            conv_kernel=config.linear_conv_kernel_dim, conv_dim=config.conv_dim,
            dtype=dtype, device=device, capture=capture, kernel_backend=kernel_backend,
            trees=trees,
        )
        return cls(kv, pool, rotary_table(config, max_len, dtype, device))

    @property
    def layer_ids(self) -> tuple[int, ...]:
        return tuple(sorted(self.kv.layer_ids + self.pool.layer_ids))

    def snapshot(self) -> CacheSnapshot:
        """A copy of the committed context: the first ``length`` KV rows and the live
        recurrent state and conv window (taken between forwards, no verify pending)."""
        pool = self.pool
        pool.check_can_advance("snapshot")
        n = self.length
        states = [pool.live_views(layer) for layer in pool.layer_ids]
        return CacheSnapshot(
            length=n,
            k=self.kv.k[:, :, :, :n].clone(),
            v=self.kv.v[:, :, :, :n].clone(),
            state=torch.stack([s for s, _ in states]) if states else pool.state.clone(),
            conv=torch.stack([c for _, c in states]) if states else pool.conv.clone(),
        )

    def restore(self, snap: CacheSnapshot) -> None:
        """Make ``snap`` the committed context (its KV rows, state and window; positions
        past it are forgotten). Refused, with nothing changed, when it does not fit these
        caches or a verify awaits its rollback."""
        kv, pool = self.kv, self.pool
        pool.check_can_advance("restore")
        want = ((*kv.k.shape[:3], snap.length, *kv.k.shape[4:]), tuple(pool.state.shape),
                tuple(pool.conv.shape))
        got = (tuple(snap.k.shape), tuple(snap.state.shape), tuple(snap.conv.shape))
        if want != got or snap.length > kv.max_len:
            raise CacheError(
                f"a snapshot of shapes {[tuple(g) for g in got]} does not fit caches of "
                f"{[tuple(w) for w in want]} with {kv.max_len} positions"
            )
        n = snap.length
        kv.k[:, :, :, :n].copy_(snap.k)
        kv.v[:, :, :, :n].copy_(snap.v)
        kv.length = n if kv.layer_ids else 0
        pool.state.copy_(snap.state)
        pool.conv.copy_(snap.conv)
        pool._set_live(None)
        pool._move_to(n)
        pool.verify = None

    @property
    def length(self) -> int:
        """Committed positions (KV length and recurrent length agree between steps)."""
        return self.kv.length if self.kv.layer_ids else self.pool.length

    @property
    def checkpoint_bytes(self) -> int:
        return self.pool.checkpoint_bytes

    @property
    def fast_unavailable_reason(self) -> str | None:
        return self.pool.fast_unavailable_reason


@dataclass(frozen=True)
class CacheSnapshot:
    """One shard's committed context, copied (:meth:`ShardCaches.snapshot`)."""

    length: int
    k: Tensor  # [L_attn, B, HKV, length, D]
    v: Tensor
    state: Tensor  # [L_rec, B, HV, K, V] float32
    conv: Tensor  # [L_rec, B, Kc-1, C]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.k, self.v, self.state, self.conv))
