"""Layer split: contiguous layer ranges ("shards") on their own devices.

``plan_shards`` turns ``--devices`` / ``--layer-split`` into a validated :class:`ShardPlan`;
:class:`ShardedTarget` places the model's layers accordingly (embeddings on the first
device, final norm and LM head on the last), gives each shard its own caches, and runs a
forward by moving the activations from shard to shard.  Each shard owns, and restores,
only its own caches.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import TypeVar

import torch
from torch import Tensor

from dflash.errors import param
from dflash.execution.capture_gate import ShardStorage
from dflash.execution.errors import (
    ContextLengthError,
    LayerSplitError,
    ShardPositionError,
    WeightsMovedError,
)
from dflash.execution.graphs import ShardCompute, ShardGraphs, ShardOutput, graphs_supported
from dflash.execution.memory import check_context_memory, context_memory
from dflash.geometry import ChainGeometry, TreeGeometry
from dflash.model import KVCache, ShardCaches, TargetModel
from dflash.model.caches import CacheSnapshot, CaptureKind
from dflash.model.layers import fuse_linear_groups_
from dflash.model.target import Mode

W = TypeVar("W")

#: tokens per prefill forward by default: big enough that a chunk's GEMMs run at full
#: rate, small enough that its activations (a few hundred MB at the 9B shape) stay far
#: below the caches of a long context
DEFAULT_PREFILL_CHUNK = 4096


def chunk_bounds(start: int, n: int, chunk: int | None) -> list[tuple[int, int]]:
    """The ``(lo, hi)`` token ranges (relative to ``start``) of a prefill of ``n`` tokens at
    position ``start`` in chunks of ``chunk`` (None: one): each chunk ends at the next
    multiple of ``chunk`` in absolute positions, or at the prompt's end."""
    if chunk is None:
        return [(0, n)]
    out, lo = [], 0
    while lo < n:
        hi = min((start + lo) // chunk * chunk + chunk - start, n)
        out.append((lo, hi))
        lo = hi
    return out


def check_prefill_chunk(value: object) -> int | None:
    """``value`` if it is a prefill chunk (an int >= 1, or None: the whole prompt in one
    forward), else ``ValueError`` naming it."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"'prefill_chunk' must be an int >= 1 or None (got {value!r})")
    return value


@dataclass(frozen=True)
class ShardPlan:
    """``devices[k]`` runs ``split[k]`` consecutive layers; together they cover the model."""

    devices: tuple[str, ...]
    split: tuple[int, ...]

    @property
    def ranges(self) -> tuple[tuple[int, int], ...]:
        out, lo = [], 0
        for n in self.split:
            out.append((lo, lo + n))
            lo += n
        return tuple(out)


def _parse_list(value: str | Sequence[str] | Sequence[int] | int, name: str) -> list[str]:
    if isinstance(value, int) and not isinstance(value, bool):
        value = [value]  # one shard's count
    if not isinstance(value, str | Sequence):
        raise LayerSplitError(
            f"{param(name)} must be a comma-separated str or a list (got {value!r})"
        )
    items = value.split(",") if isinstance(value, str) else [str(v) for v in value]
    items = [i.strip() for i in items]
    if not items or any(not i for i in items):
        raise LayerSplitError(
            f"{param(name)} must be a comma-separated list without empty entries "
            f"(got {value!r})"
        )
    return items


def plan_shards(
    num_layers: int,
    devices: str | Sequence[str] = "cpu",
    split: str | Sequence[int] | int | None = None,
) -> ShardPlan:
    """Validate a layer split; every refusal names the rule and the value.

    Messages name the parameters ``'devices'`` and ``'layer_split'`` (``split``); the
    command line spells them ``--devices`` / ``--layer-split``
    (:meth:`dflash.errors.UsageError.worded`).
    """
    devs = _parse_list(devices, "devices")
    for d in devs:
        try:
            dev = torch.device(d)
        except RuntimeError as exc:
            raise LayerSplitError(
                f"{param('devices')} entry {d!r} is not a torch device ({exc})"
            ) from None
        if dev.type == "cuda":
            if not torch.cuda.is_available():
                raise LayerSplitError(
                    f"{param('devices')} entry {d!r}: CUDA is not available here"
                )
            if (dev.index or 0) >= torch.cuda.device_count():
                raise LayerSplitError(
                    f"{param('devices')} entry {d!r}: only {torch.cuda.device_count()} "
                    "CUDA device(s)"
                )
    if split is None:
        if num_layers < len(devs):
            raise LayerSplitError(
                f"{len(devs)} devices need at least {len(devs)} layers (model has {num_layers})"
            )
        base, extra = divmod(num_layers, len(devs))
        counts = [base + (1 if k < extra else 0) for k in range(len(devs))]
    else:
        raw = _parse_list(split, "layer_split")
        try:
            counts = [int(c) for c in raw]
        except ValueError:
            raise LayerSplitError(
                f"{param('layer_split')} entries must be integers (got {split!r})"
            ) from None
    if len(counts) != len(devs):
        raise LayerSplitError(
            f"{param('layer_split')} has {len(counts)} counts but {param('devices')} names "
            f"{len(devs)} devices (split {counts}, devices {devs})"
        )
    for k, c in enumerate(counts):
        if c <= 0:
            raise LayerSplitError(
                f"{param('layer_split')} entry {k} must be >= 1: every shard needs at "
                f"least one layer (got {c} in {counts})"
            )
    if sum(counts) != num_layers:
        raise LayerSplitError(
            f"{param('layer_split')} counts must sum to the model's {num_layers} layers "
            f"(got {counts}, sum {sum(counts)})"
        )
    return ShardPlan(devices=tuple(devs), split=tuple(counts))


def device_ids(ids: Sequence[int], device: torch.device) -> Tensor:
    """Token ids as ``[1, T]`` int64 on ``device`` (through pinned memory on CUDA, so the
    copy does not wait for the device's queue)."""
    host = torch.tensor([list(ids)], dtype=torch.int64)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


@dataclass
class Shard:
    index: int
    device: torch.device
    layers: range
    caches: ShardCaches

    def on_device(self) -> AbstractContextManager[object]:
        """Make this shard's GPU the current device (Triton launches on the current one)."""
        if self.device.type == "cuda":
            return torch.cuda.device(self.device)
        return nullcontext()

    def truncate_kv(self, n: int) -> None:
        """Keep the first ``n`` KV positions (a shard without attention layers has none)."""
        if self.caches.kv.layer_ids:
            self.caches.kv.truncate(n)

    def storage(self, model: TargetModel) -> ShardStorage:
        cfg = model.config
        pool = self.caches.pool
        batch = pool.state.shape[1] if pool.state.dim() == 5 else 1
        return ShardStorage(
            index=self.index,
            device=str(self.device),
            layers=(self.layers.start, self.layers.stop),
            owned_recurrent=tuple(i for i in self.layers if i in cfg.recurrent_layer_ids),
            pool=pool,
            state_shape=(
                batch,
                cfg.linear_num_value_heads,
                cfg.linear_key_head_dim,
                cfg.linear_value_head_dim,
            ),
            conv_rows_shape=(batch, cfg.linear_conv_kernel_dim - 1, cfg.conv_dim),
        )


def _weight_addresses(model: TargetModel) -> tuple[tuple[str, int, torch.dtype, str], ...]:
    """``(name, address, dtype, device)`` of every parameter (a tied one once)."""
    return tuple(
        (name, p.data_ptr(), p.dtype, str(p.device)) for name, p in model.named_parameters()
    )


def _last_rows(rows: Tensor, n: int) -> Tensor:
    """The last ``n`` rows (dimension 1) of ``rows`` (all when it has fewer; none for 0)."""
    return rows[:, max(0, rows.shape[1] - n):]


class ShardedTarget:
    """The target model run as contiguous shards; see the module docstring.

    ``graphs``: capture the decode, verify and replay forwards in CUDA graphs (one per
    shard, :mod:`dflash.execution.graphs`); ``None`` = wherever supported (every shard on
    CUDA, Triton kernels, no mixture-of-experts layers), ``False`` = always eager. CPU
    shards always run eagerly (the same code). ``capture``: what a verify captures;
    ``trees``: tree verifies will run (capturing inputs, each pool then holds a tree's
    node-state scratch).
    """

    def __init__(
        self,
        model: TargetModel,
        plan: ShardPlan,
        *,
        max_len: int,
        max_draft: int,
        graphs: bool | None = None,
        capture: CaptureKind = "states",
        trees: bool = False,
        prefill_chunk: int | None = DEFAULT_PREFILL_CHUNK,
    ):
        if len(plan.split) and sum(plan.split) != model.config.num_hidden_layers:
            raise LayerSplitError(
                f"plan covers {sum(plan.split)} layers, the model has "
                f"{model.config.num_hidden_layers}"
            )
        #: tokens per prefill forward (:meth:`prefill`); the memory check sizes one
        self.prefill_chunk = check_prefill_chunk(prefill_chunk)
        self._check_memory(model, plan, max_len, max_draft, capture, trees, self.prefill_chunk)
        self.model, self.plan = model, plan
        self.max_len, self.max_draft = max_len, max_draft
        self.capture: CaptureKind = capture
        #: tree verifies run on it: capturing inputs, each pool holds a tree's node-state
        #: scratch (``RecurrentPool(trees=True)``)
        self.trees = trees
        devices = [torch.device(d) for d in plan.devices]
        self._place()
        self.shards: list[Shard] = []
        for k, ((lo, hi), dev) in enumerate(zip(plan.ranges, devices, strict=True)):
            self.shards.append(Shard(k, dev, range(lo, hi), self._new_caches(range(lo, hi), dev)))
        self._weights = _weight_addresses(model)
        why_not = graphs_supported(model, devices)
        if graphs and why_not is not None:
            raise ValueError(f"'graphs'=True but {why_not}")
        self.graphs_off_reason = "disabled" if graphs is False else why_not
        self.graphs: list[ShardGraphs] | None = (
            [ShardGraphs(s.device) for s in self.shards] if self.graphs_off_reason is None else None
        )

    @staticmethod
    def _check_memory(
        model: TargetModel, plan: ShardPlan, max_len: int, max_draft: int,
        capture: CaptureKind, trees: bool, prefill_chunk: int | None,
    ) -> None:
        """Before any cache is allocated: each shard's context must fit its device's free
        memory (:func:`dflash.execution.memory.check_context_memory`), else
        :class:`~dflash.execution.memory.InsufficientMemoryError` with the estimate. Shards
        on one device add up."""
        dtype = model.embed_tokens.weight.dtype
        counted: dict[str, int] = {}
        last = len(plan.ranges) - 1
        for k, ((lo, hi), device) in enumerate(zip(plan.ranges, plan.devices, strict=True)):
            memory = context_memory(
                model.config, range(lo, hi), max_len=max_len, max_draft=max_draft,
                dtype=dtype, capture=capture, trees=trees, prefill_chunk=prefill_chunk,
                last_shard=k == last,
            )
            check_context_memory(
                memory, device, already=counted.get(device, 0),
                what=f"a context of {max_len} positions (shard {k}, layers {lo}-{hi - 1})",
            )
            counted[device] = counted.get(device, 0) + memory.required

    def cannot_serve(
        self, model: TargetModel, plan: ShardPlan, *, max_len: int, max_draft: int,
        graphs: bool | None, prefill_chunk: int | None = DEFAULT_PREFILL_CHUNK,
    ) -> str | None:
        """Why this target cannot run a generation with these settings (None: it can).

        A target is reusable across generations (its CUDA graphs are then captured once):
        :meth:`forward` in ``prefill`` mode resets its caches for the new prompt.
        """
        if model is not self.model:
            return "it was built for another model"
        if plan != self.plan:
            return f"it was built for layer split {self.plan.split} on {self.plan.devices}"
        if max_len > self.max_len:
            return f"it holds {self.max_len} positions, the generation needs {max_len}"
        if max_draft > self.max_draft:
            return f"it captures {self.max_draft} slots, the generation needs {max_draft}"
        if prefill_chunk != self.prefill_chunk:
            return f"it prefills in chunks of {self.prefill_chunk}, not {prefill_chunk}"
        if graphs is False and self.graphs is not None:
            return "graphs=False was asked for a target that captures CUDA graphs"
        if graphs and self.graphs is None:
            return f"graphs=True was asked for a target without graphs ({self.graphs_off_reason})"
        return None

    def _place(self) -> None:
        """Every layer on its shard's device (a no-op for layers already there); run once,
        when the target is built. A moved layer's projection groups are fused again by
        the move itself (:class:`dflash.model.layers.GroupedModule`)."""
        model, devices = self.model, [torch.device(d) for d in self.plan.devices]
        model.embed_tokens.to(devices[0])
        model.norm.to(devices[-1])
        model.lm_head.to(devices[-1])
        model.tie_weights_()
        for (lo, hi), dev in zip(self.plan.ranges, devices, strict=True):
            for i in range(lo, hi):
                model.layers[i].to(dev)

    def require_serves(
        self, model: TargetModel, plan: ShardPlan, *, max_len: int, max_draft: int,
        graphs: bool | None, what: str, prefill_chunk: int | None = DEFAULT_PREFILL_CHUNK,
    ) -> ShardedTarget:
        """``self`` when it can run ``what`` with these settings, else ``ValueError`` naming
        why (:meth:`cannot_serve`)."""
        why = self.cannot_serve(model, plan, max_len=max_len, max_draft=max_draft,
                                graphs=graphs, prefill_chunk=prefill_chunk)
        if why is not None:
            raise ValueError(f"'target' cannot run this {what}: {why}")
        return self

    def _check_weights(self) -> None:
        """At each prefill (one address per parameter, no copy): the weights must still
        have the devices and dtypes :meth:`_place` gave them, else
        :class:`WeightsMovedError` naming the first that moved (the caches and CUDA graphs
        were built for them; a new target places the model where it is now). Projection
        groups whose parameter was replaced since are fused again (``param.data = t``;
        :class:`dflash.model.layers.LinearGroup`), and the CUDA graphs are forgotten when
        a parameter is no longer the tensor they were captured with (a graph holds
        addresses: it would read freed memory)."""
        fuse_linear_groups_(self.model)
        now = _weight_addresses(self.model)
        placed = {name: (dtype, device) for name, _, dtype, device in self._weights}
        for name, _, dtype, device in now:
            was = placed.get(name)
            if was != (dtype, device):
                where = "a new parameter" if was is None else f"{was[0]} on {was[1]}"
                raise WeightsMovedError(
                    f"parameter {name!r} is {dtype} on {device}, but this target placed it "
                    f"as {where} (the model was moved or cast since: build a new "
                    "ShardedTarget for it)"
                )
        if now != self._weights:
            for graphs in self.graphs or ():
                graphs.reset()
            self._weights = now

    def _new_caches(
        self, layers: range, device: torch.device, kv: KVCache | None = None
    ) -> ShardCaches:
        return ShardCaches.for_layers(
            self.model.config,
            layers,
            max_len=self.max_len,
            max_draft=self.max_draft,
            dtype=self.model.embed_tokens.weight.dtype,
            device=device,
            kv=kv,
            capture=self.capture,
            kernel_backend=self.model.backend_for(device),
            trees=self.trees,
        )

    @property
    def config(self):  # type: ignore[no-untyped-def]  # HybridConfig, re-exported for callers
        return self.model.config

    def storages(self) -> list[ShardStorage]:
        return [s.storage(self.model) for s in self.shards]

    @property
    def checkpoint_bytes(self) -> int:
        return sum(s.caches.checkpoint_bytes for s in self.shards)

    @property
    def capture_bytes(self) -> dict[str, int]:
        """:attr:`checkpoint_bytes` by buffer name, summed over the shards."""
        out: dict[str, int] = {}
        for s in self.shards:
            for name, size in s.caches.pool.capture_bytes.items():
                out[name] = out.get(name, 0) + size
        return out

    @property
    def fast_unavailable_reason(self) -> str | None:
        """Why fast rollback cannot run (a shard's capture storage did not fit), else None."""
        reasons = [
            f"shard {s.index}: {s.caches.fast_unavailable_reason}"
            for s in self.shards
            if s.caches.fast_unavailable_reason is not None
        ]
        return "; ".join(reasons) if reasons else None

    def forward(
        self,
        ids: Sequence[int] | Tensor,
        mode: Mode,
        start: int,
        *,
        geometry: ChainGeometry | TreeGeometry | None = None,
        taps: Sequence[int] = (),
        after_shard: Callable[[int], None] | None = None,
    ) -> tuple[Tensor, dict[int, Tensor]]:
        """``ids`` at positions ``start…`` through every shard → (logits ``[T, vocab]``, taps;
        a prefill: its last row's ``[1, vocab]``).

        ``ids``: token ids, or the ``[1, T]`` int64 tensor :func:`device_ids` made of them
        on the first shard's device (a caller that needs them on the device too uploads
        them once).

        Each shard: host checks and bookkeeping, then its device work — replayed from a
        CUDA graph when graphs are on and the mode is not ``prefill`` — then
        ``after_shard(k)`` on the host (the capture gate inspects storage between the
        shards; its reads wait for the shard's graph like any later device work).
        """
        out, tapped = self._forward(ids, mode, start, geometry, taps, after_shard, True)
        assert out is not None  # the last shard computed the LM head
        return out, tapped

    def prefill(
        self,
        ids: Sequence[int],
        start: int = 0,
        *,
        taps: Sequence[int] = (),
        on_chunk: Callable[[int, int], None] | None = None,
        tap_rows: int | None = None,
    ) -> tuple[Tensor, dict[int, Tensor]]:
        """``ids`` at positions ``start…`` in ``prefill`` forwards of at most
        :attr:`prefill_chunk` tokens each (None: one forward) → (the last token's logits
        ``[1, vocab]``, the ``taps`` layers' outputs ``[1, len(ids), H]``, or only their
        last ``tap_rows`` rows, the only ones kept between chunks). A prefill is
        not M-invariant: plain and speculative decoding compared bit for bit prefill in
        the same chunks (their targets share the setting, :meth:`cannot_serve`).

        ``start`` 0 begins a new sequence (the caches are reset); the committed length
        continues the one in the caches (a conversation's next turn). Chunks end at
        multiples of :attr:`prefill_chunk` in absolute positions (:func:`chunk_bounds`), so
        the state at such a position is the same bits whether it was reached by one
        prefill or by a prefill that continued there. Each chunk attends
        the cache so far and itself and advances the recurrent state, so a prefill's
        memory is the caches plus one chunk's activations; only the last row goes
        through the LM head. ``on_chunk(done, total)`` is called after each chunk, on the
        host (a progress display)."""
        n = len(ids)
        self.check_prefill(n, start)
        logits: Tensor | None = None
        parts: dict[int, list[Tensor]] = {}
        for lo, hi in chunk_bounds(start, n, self.prefill_chunk):
            logits, got = self._forward(ids[lo:hi], "prefill", start + lo, None, taps, None,
                                        hi == n)
            for layer, rows in got.items():
                kept = parts.setdefault(layer, [])
                kept.append(rows if tap_rows is None else _last_rows(rows, tap_rows))
                while tap_rows is not None and sum(r.shape[1] for r in kept[1:]) >= tap_rows:
                    kept.pop(0)  # wholly before the last tap_rows rows
            if on_chunk is not None:
                on_chunk(hi, n)
        assert logits is not None  # the last chunk computed the LM head
        joined = {k: v[0] if len(v) == 1 else torch.cat(v, dim=1) for k, v in parts.items()}
        if tap_rows is not None:
            joined = {k: _last_rows(v, tap_rows) for k, v in joined.items()}
        return logits, joined

    def snapshot(self) -> list[CacheSnapshot]:
        """Every shard's committed context, copied (:meth:`ShardCaches.snapshot`): what a
        prefix cache keeps at a prefill's chunk boundary."""
        out = []
        for shard in self.shards:
            with shard.on_device():
                out.append(shard.caches.snapshot())
        return out

    def restore(self, snaps: Sequence[CacheSnapshot]) -> None:
        """Make ``snaps`` (one per shard, of equal length) the committed context; checked
        for every shard before any changes."""
        if len(snaps) != len(self.shards) or len({s.length for s in snaps}) != 1:
            raise ShardPositionError(
                f"a snapshot of {len(snaps)} shards at lengths {[s.length for s in snaps]} "
                f"cannot restore {len(self.shards)} shards"
            )
        if snaps[0].length > self.max_len:
            raise ContextLengthError(
                f"a snapshot of {snaps[0].length} positions exceeds the caches' {self.max_len}"
            )
        for shard in self.shards:
            shard.caches.pool.check_can_advance("restore")
        for shard, snap in zip(self.shards, snaps, strict=True):
            with shard.on_device():
                shard.caches.restore(snap)

    def check_prefill(self, n: int, start: int) -> None:
        """Refuse, before anything runs (the caches stay as they are), a prefill of ``n``
        tokens at ``start`` that cannot run: no token, a bad start, more positions than
        the caches hold (:class:`ContextLengthError`), or a start that does not continue
        every shard's caches (:class:`ShardPositionError`)."""
        if n == 0:
            raise ValueError("a prefill needs at least one token (got none)")
        if isinstance(start, bool) or not isinstance(start, int) or start < 0:
            raise ValueError(f"'start' must be an int >= 0 (got {start!r})")
        if start + n > self.max_len:
            raise ContextLengthError(
                f"a prefill of {n} tokens at position {start} needs {start + n} positions; "
                f"the caches hold {self.max_len}"
            )
        if start:
            held = {p for pair in self.positions() for p in pair if p is not None}
            if held != {start}:
                raise ShardPositionError(
                    f"a prefill at position {start} continues the caches, but they hold "
                    f"{self.positions()} (KV, recurrent) positions per shard"
                )

    def replay(self, ids: Sequence[int], start: int) -> None:
        """``ids`` at ``start…`` in ``replay`` mode, caches only (no LM head)."""
        self._forward(ids, "replay", start, None, (), None, False)

    @torch.inference_mode()
    def _forward(
        self,
        ids: Sequence[int] | Tensor,
        mode: Mode,
        start: int,
        geometry: ChainGeometry | TreeGeometry | None,
        taps: Sequence[int],
        after_shard: Callable[[int], None] | None,
        logits: bool,
    ) -> tuple[Tensor | None, dict[int, Tensor]]:
        first = self.shards[0].device
        if isinstance(ids, Tensor):
            if ids.dim() != 2 or ids.shape[0] != 1 or ids.dtype != torch.int64 or (
                ids.device != first
            ):
                raise ValueError(
                    f"token ids as a tensor must be [1, T] int64 on {first} (got "
                    f"{list(ids.shape)} {ids.dtype} on {ids.device})"
                )
            x = ids
        else:
            x = device_ids(ids, first)  # [1, T] int64
        t = x.shape[1]
        if mode == "prefill" and start == 0:  # a new sequence: the weights may have changed
            self._check_weights()
        hidden_size = self.model.config.hidden_size
        graphed = self.graphs is not None and mode != "prefill"
        # a tree verify reads its tables from device buffers begin_layers refills
        # (ShardCaches.tree): one graph per tree size serves every tree of that size
        kind = "verify-tree" if isinstance(geometry, TreeGeometry) else str(mode)
        tapped: dict[int, Tensor] = {}
        out_logits: Tensor | None = None
        for shard in self.shards:
            x = x.to(shard.device)
            layers = tuple(shard.layers)
            with shard.on_device():
                self.model.begin_layers((1, t, hidden_size), layers, shard.caches, start, mode,
                                        geometry)
                compute = self._shard_compute(shard, mode, geometry, taps, logits, start)
                pool = shard.caches.pool
                mark = pool.end_verify_layer if mode == "verify" else None
                if graphed and self.graphs is not None:
                    key = (kind, t, logits)
                    x, out_logits, got = self.graphs[shard.index].run(key, x, compute, mark)
                else:
                    x, out_logits, got = compute(x, mark)
                self.model.end_layers(layers, shard.caches, start, mode, t)
            tapped.update(got)
            if after_shard is not None:
                after_shard(shard.index)
        return (None if out_logits is None else out_logits[0]), tapped

    def _shard_compute(
        self,
        shard: Shard,
        mode: Mode,
        geometry: ChainGeometry | TreeGeometry | None,
        taps: Sequence[int],
        logits: bool,
        start: int,
    ) -> ShardCompute:
        """The device work of ``shard``'s part of a forward (capture-safe unless prefill).

        ``start`` (the position of row 0) only places the LM head's rows on CPU position
        tiles; CUDA forwards, and so CUDA graphs, read positions from the device."""
        model, layers, caches = self.model, tuple(shard.layers), shard.caches
        first, last = shard.index == 0, shard.index == len(self.shards) - 1

        def compute(x: Tensor, on_layer: Callable[[int], None] | None) -> ShardOutput:
            hidden = model.embed_tokens(x) if first else x  # [1, T, H]
            hidden, got = model.compute_layers(
                hidden, layers, caches, mode, geometry, taps, on_layer
            )
            offsets = geometry.depth if isinstance(geometry, TreeGeometry) else None
            # a prefill needs its last row's logits only (a long prompt's [T, vocab] would
            # outweigh the model)
            rows = hidden[:, -1:] if mode == "prefill" else hidden
            head = (  # [1, T, V], [1, 1, V] for a prefill
                model.logits(rows, mode, start, offsets) if last and logits else None
            )
            return hidden, head, got

        return compute

    # -- work on the last forward's logits ----------------------------------------------

    def on_logits(
        self, name: str, logits: Tensor, x: Tensor, owner: object, work: Callable[[Tensor], W]
    ) -> W:
        """Device work ``work(x)`` over the last forward's ``logits`` (on the last shard's
        device; ``x`` there too): the step's acceptance, a plain decode's draw. With
        graphs on it is replayed from a CUDA graph of the last shard, key
        ``("logits:<name>", rows, False)``, while ``logits`` is the memory the graph was
        captured on (a verify graph's output is, replay after replay) and ``owner`` — the
        rule the work applies, compared by equality — is the graph's; else it runs
        eagerly. Nothing is read back to the host."""
        if self.graphs is None:
            return work(x)
        graphs = self.graphs[-1]
        graphs.bind("logits", owner)
        with self.shards[-1].on_device():
            return graphs.run_reading((f"logits:{name}", int(logits.shape[0]), False), x,
                                      logits, work)

    # -- rollback with the accepted count on the device ---------------------------------

    def enqueue_rollback(self, shard: Shard, mode: str, commit_n: Tensor) -> None:
        """Enqueue ``shard``'s fast rollback (``"checkpoint"``, ``"remap"`` or
        ``"recompute"``) on the
        accepted count ``commit_n`` (int64 ``[1]``, still on the device): host checks,
        then the device work — replayed from a CUDA graph when graphs are on. The count
        is read back later; :meth:`finish_rollback` then updates the host mirrors."""
        pool = shard.caches.pool
        with shard.on_device():
            pool.mark_device_rollback(mode)
            n = commit_n if commit_n.device == shard.device else commit_n.to(shard.device)
            if self.graphs is None:
                pool.rollback_on_device(mode, n)
            else:
                self.graphs[shard.index].run_rollback(
                    mode, n, lambda count: pool.rollback_on_device(mode, count)
                )

    def enqueue_tree_rollback(self, shard: Shard, mode: str, accepted: Tensor) -> None:
        """Enqueue ``shard``'s fast rollback of a tree verify to its accepted node, known
        only on the device: ``accepted`` int64 ``[2 + T]`` = (node, path length, the
        ``-1``-padded path). Host checks, then the device work — the path's K/V rows
        compacted from the verify's start, the recurrent state and conv window from the
        node (``RecurrentPool.rollback_tree_on_device``) — replayed from a CUDA graph when
        graphs are on. :meth:`finish_tree_rollback` once the path was read back."""
        caches = shard.caches
        pool = caches.pool
        with shard.on_device():
            pool.mark_device_rollback(mode)
            a = accepted if accepted.device == shard.device else accepted.to(shard.device)

            def work(a: Tensor) -> None:
                best, count, path = a[0:1], a[1:2], a[2:]
                caches.kv.compact_on_device(pool.position, path)  # before position moves
                pool.rollback_tree_on_device(mode, best, count, path)

            if self.graphs is None:
                work(a)
            else:
                self.graphs[shard.index].run_rollback(f"tree:{mode}", a, work)

    def finish_tree_rollback(
        self, shard: Shard, mode: str, path: Sequence[int], committed: int
    ) -> None:
        """Host side of ``shard``'s enqueued tree rollback: the pool's mirrors and the KV
        length with the accepted ``path`` read back (each checks it)."""
        shard.caches.pool.finish_tree_rollback(mode, path)
        shard.caches.kv.mark_compacted(committed, path)

    def finish_rollback(self, shard: Shard, mode: str, commit_n: int, committed: int) -> None:
        """Host side of ``shard``'s enqueued rollback: the pool's mirrors with the count
        read back, and the KV cache truncated to ``committed + commit_n``."""
        shard.caches.pool.finish_rollback(mode, commit_n)
        shard.truncate_kv(committed + commit_n)

    # -- positions -----------------------------------------------------------------------

    def positions(self) -> list[tuple[int | None, int | None]]:
        """Per shard: (KV length or None without attention layers, recurrent length or None)."""
        out: list[tuple[int | None, int | None]] = []
        for s in self.shards:
            kv, pool = s.caches.kv, s.caches.pool
            out.append(
                (kv.length if kv.layer_ids else None, pool.length if pool.layer_ids else None)
            )
        return out

    def require_position(self, committed: int, *, kv_extra: int = 0, what: str) -> None:
        """Every shard's recurrent length is ``committed``, its KV length ``committed+kv_extra``."""
        for k, (kv_len, rec_len) in enumerate(self.positions()):
            if rec_len is not None and rec_len != committed:
                raise ShardPositionError(
                    f"{what}: shard {k} recurrent length is {rec_len}, expected {committed} "
                    f"(positions per shard {self.positions()})"
                )
            if kv_len is not None and kv_len != committed + kv_extra:
                raise ShardPositionError(
                    f"{what}: shard {k} KV length is {kv_len}, expected {committed + kv_extra} "
                    f"(positions per shard {self.positions()})"
                )

    def rebuild_storage(
        self, capture: CaptureKind | None = None, *, trees: bool | None = None
    ) -> None:
        """Fresh capture storage for every shard (of kind ``capture``, for tree verifies
        with ``trees``; None: as now); the live state (wherever it lies) and the KV cache
        are carried over, so decoding continues unchanged."""
        if capture is not None:
            self.capture = capture
        if trees is not None:
            self.trees = trees
        for s in self.shards:
            old = s.caches
            new = self._new_caches(s.layers, s.device, kv=old.kv)
            new.pool.adopt_live(old.pool)
            s.caches = new
        if self.graphs is not None:  # they hold the old storage's addresses
            for g in self.graphs:
                g.reset()
