"""What a context costs in memory, checked before any cache is allocated.

A target's caches for ``max_len`` positions — the attention layers' keys and values, the
recurrent layers' state and conv window, the verify's capture storage, the rotary table —
are counted exactly: :class:`dflash.model.ShardCaches` is built on the ``meta`` device
(shapes and dtypes, no storage) and its tensors are summed. A prefill then needs one
chunk's activations on top (:func:`prefill_workspace_bytes`, an upper estimate).

:func:`check_context_memory` compares that with the free memory of each shard's device
(after the weights were built) and refuses, naming the estimate part by part, when the
part a run cannot do without does not fit. The capture storage is reported but not
required: when it cannot be allocated the engine keeps fast rollback ``requested`` and
rolls back through replay (:attr:`dflash.model.caches.RecurrentPool.fast_unavailable_reason`).
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from dflash.errors import ExecutionError
from dflash.model.caches import CaptureKind, ShardCaches
from dflash.model.config import HybridConfig

GB = 10**9


class InsufficientMemoryError(ExecutionError):
    """The model or its context does not fit on its device; the message names the sizes
    and the free memory."""


def size_text(n: int) -> str:
    """``12.3 GB`` / ``45.6 MB``."""
    return f"{n / GB:.1f} GB" if n >= 10**8 else f"{n / 1e6:.1f} MB"


def available_bytes(device: str) -> tuple[int, str] | None:
    """Free memory on ``device`` and where the number comes from (None: unknown)."""
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            return None
        free, _total = torch.cuda.mem_get_info(torch.device(device))
        return int(free), "torch.cuda.mem_get_info"
    try:  # psutil is optional: used when installed, else Linux's /proc/meminfo
        psutil = importlib.import_module("psutil")
        return int(psutil.virtual_memory().available), "psutil available memory"
    except ImportError:
        pass
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024, "MemAvailable in /proc/meminfo"
    except (OSError, ValueError, IndexError):
        return None
    return None


@dataclass(frozen=True)
class ContextMemory:
    """Bytes of one shard's context: ``kv`` (attention keys and values), ``state``
    (recurrent state, conv window, pre-verify snapshot, rotary table, small tables),
    ``capture`` (the verify's per-token capture storage: optional, see the module
    docstring) and ``workspace`` (one prefill chunk's activations)."""

    kv: int
    state: int
    capture: int
    workspace: int

    @property
    def required(self) -> int:
        """What a run cannot do without (everything but the capture storage)."""
        return self.kv + self.state + self.workspace

    def describe(self) -> str:
        parts = [
            f"KV {size_text(self.kv)}",
            f"recurrent state {size_text(self.state)}",
            f"prefill workspace {size_text(self.workspace)}",
        ]
        return (
            f"{' + '.join(parts)} = {size_text(self.required)}, and "
            f"{size_text(self.capture)} of fast-rollback capture (replay when it does not fit)"
        )


def _bytes(tensors: Sequence[torch.Tensor | None]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def prefill_workspace_bytes(
    config: HybridConfig, chunk: int, dtype: torch.dtype, *, last_shard: bool = True
) -> int:
    """An upper estimate of one ``chunk``-token prefill forward's live activations: a
    layer's inputs, projections and outputs at once (the widest of the MLP, the Gated
    DeltaNet and the attention mixer, each counted with its float32 intermediates), twice
    over for the allocator's slack, and the LM head's one row (float32) on the last
    shard."""
    item = dtype.itemsize
    hidden = config.hidden_size
    mlp = 3 * config.intermediate_size * item
    gdn = (2 * config.conv_dim + 2 * config.linear_value_dim) * item + 4 * (
        2 * config.linear_num_value_heads + config.linear_value_dim
    )
    attn = (3 * config.num_attention_heads + 2 * config.num_key_value_heads) * (
        config.head_dim * item
    )
    per_token = 4 * hidden * item + max(mlp, gdn, attn)
    head = config.vocab_size * 4 if last_shard else 0
    return 2 * chunk * per_token + head


def context_memory(
    config: HybridConfig,
    layers: Sequence[int],
    *,
    max_len: int,
    max_draft: int,
    dtype: torch.dtype,
    capture: CaptureKind,
    trees: bool,
    prefill_chunk: int | None,
    last_shard: bool = True,
) -> ContextMemory:
    """One shard's :class:`ContextMemory` for ``max_len`` positions (exact for the caches;
    ``prefill_chunk`` None: a whole ``max_len`` prompt in one forward)."""
    caches = ShardCaches.for_layers(
        config, tuple(layers), max_len=max_len, max_draft=max_draft, dtype=dtype,
        device="meta", capture=capture, trees=trees,
    )
    pool = caches.pool
    capture_part = _bytes([*pool.capture_buffers().values(), pool.tree_states])
    state_part = _bytes([
        pool.state, pool.conv, pool.snapshot, pool.live, pool.position, *caches.rope,
        caches.tree.depth, caches.tree.paths,
    ])
    chunk = max_len if prefill_chunk is None else min(prefill_chunk, max_len)
    return ContextMemory(
        kv=_bytes([caches.kv.k, caches.kv.v]),
        state=state_part,
        capture=capture_part,
        workspace=prefill_workspace_bytes(config, chunk, dtype, last_shard=last_shard),
    )


def check_context_memory(
    memory: ContextMemory, device: str, *, what: str, already: int = 0
) -> None:
    """:class:`InsufficientMemoryError` when ``memory.required`` (plus ``already`` bytes
    counted on the same device) exceeds ``device``'s free memory; unknown free memory
    passes."""
    free = available_bytes(device)
    if free is None:
        return
    need = memory.required + already
    if need > free[0]:
        raise InsufficientMemoryError(
            f"{what} needs about {size_text(need)} on {device} ({memory.describe()}), but "
            f"only {size_text(free[0])} is free ({free[1]}); lower --max-context or "
            "--prefill-chunk, or split the layers over more devices"
        )


__all__ = [
    "ContextMemory",
    "InsufficientMemoryError",
    "available_bytes",
    "check_context_memory",
    "context_memory",
    "prefill_workspace_bytes",
    "size_text",
]
