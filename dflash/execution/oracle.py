"""Target-only greedy decoding on a :class:`ShardedTarget` — the parity oracle.

``plain``: prefill, then one ``decode`` forward per token (what ``greedy_generate`` does,
here across shards).  ``deterministic``: every decode forward runs at the verify's shape —
the pending token followed by ``block_size - 1`` pad rows, in ``verify`` mode — and the
live state takes checkpoint slot 0, so each generated token's row goes through the same
kernels in the same shapes as the speculative loop's verify and replay forwards.  Pad rows
come after the real token and cannot influence its row (causal attention, sequential
recurrence); they are dropped by the rollback to one token.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dflash.execution.engine import chain_of
from dflash.execution.shards import ShardedTarget, ShardPlan
from dflash.model import TargetModel


@torch.inference_mode()
def reference_greedy(
    model: TargetModel,
    plan: ShardPlan,
    prompt: Sequence[int],
    n: int,
    *,
    deterministic: bool,
    block_size: int,
) -> list[int]:
    """The ``n`` target-only greedy tokens after ``prompt`` (see the module docstring)."""
    if n <= 0:
        return []
    width = block_size if deterministic else 1
    target = ShardedTarget(model, plan, max_len=len(prompt) + n + width, max_draft=width)
    logits, _ = target.forward(list(prompt), "prefill", 0)
    out = [int(logits[-1].argmax())]
    committed = len(prompt)
    while len(out) < n:
        last = out[-1]
        if deterministic:
            logits, _ = target.forward(
                [last] * block_size, "verify", committed, geometry=chain_of(block_size)
            )
            for shard in target.shards:
                with shard.on_device():
                    shard.caches.pool.restore_checkpoint(1)
                shard.truncate_kv(committed + 1)
        else:
            logits, _ = target.forward([last], "decode", committed)
        committed += 1
        out.append(int(logits[0].argmax()))
    return out
