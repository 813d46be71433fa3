"""Plain target-only greedy decoding on a :class:`ShardedTarget` — the parity oracle.

Prefill, then one ``decode`` forward per token: what :func:`dflash.model.greedy_generate`
does, here across shards. No checkpoint slots, no capture, no rollback: nothing of the
speculative machinery it checks. Speculative output equals it bit for bit because every
decode, verify and replay forward runs on M-invariant kernels (specs/rollback.md).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from dflash.execution.shards import DEFAULT_PREFILL_CHUNK, ShardedTarget, ShardPlan
from dflash.model import TargetModel
from dflash.sampling import GREEDY, SamplingParams, sample_tokens


@torch.inference_mode()
def greedy_target(
    model: TargetModel, plan: ShardPlan, prompt_len: int, n: int, *, graphs: bool | None = None,
    prefill_chunk: int | None = DEFAULT_PREFILL_CHUNK,
) -> ShardedTarget:
    """A target for :func:`reference_greedy` of ``n`` tokens after a ``prompt_len``-token
    prompt (keep it and pass it as ``target=`` to decode again without new CUDA graphs)."""
    return ShardedTarget(model, plan, max_len=prompt_len + n, max_draft=1, graphs=graphs,
                         prefill_chunk=prefill_chunk)


def reference_greedy(
    model: TargetModel,
    plan: ShardPlan,
    prompt: Sequence[int],
    n: int,
    *,
    graphs: bool | None = None,
    on_prefill: Callable[[], None] | None = None,
    target: ShardedTarget | None = None,
    sampling: SamplingParams = GREEDY,
    prefill_chunk: int | None = DEFAULT_PREFILL_CHUNK,
) -> list[int]:
    """The ``n`` target-only tokens after ``prompt``, one token per forward, each drawn by
    the sampling rule (:mod:`dflash.sampling`; greedy by default) at its absolute position:
    plain (sampled) decoding, the oracle of speculative decoding under the same rule.

    ``graphs``: replay each decode forward from a CUDA graph (None: wherever supported).
    ``on_prefill``: called once the prefill's token is known, before the first decode
    forward (where a caller starts timing the decode). ``target``: a :class:`ShardedTarget`
    kept across calls (decode graphs captured once); it must serve this model, plan and
    length, else ``ValueError`` names why. Only its decode path runs. ``prefill_chunk``:
    tokens per prefill forward (:meth:`ShardedTarget.prefill`); speculative decoding
    compared with this oracle must prefill in the same chunks (a prefill is not
    M-invariant: other chunks give other bits).
    """
    if n <= 0:
        return []
    if target is None:
        target = greedy_target(model, plan, len(prompt), n, graphs=graphs,
                               prefill_chunk=prefill_chunk)
    else:
        target.require_serves(model, plan, max_len=len(prompt) + n, max_draft=1,
                              graphs=graphs, what="greedy decode", prefill_chunk=prefill_chunk)
    logits, _ = target.prefill(list(prompt), 0)
    out = [next_token(target, logits[-1:], sampling, decode=False)]
    if on_prefill is not None:
        on_prefill()
    committed = len(prompt)
    while len(out) < n:
        logits, _ = target.forward([out[-1]], "decode", committed)
        committed += 1
        out.append(next_token(target, logits[:1], sampling))
    return out


def next_token(
    target: ShardedTarget, row: torch.Tensor, sampling: SamplingParams, *, decode: bool = True
) -> int:
    """The token plain decoding draws from ``row`` (``[1, vocab]``, the last logits of a
    decode on ``target``, or of its prefill with ``decode=False``): after either forward
    the device's committed position is the drawn token's position, the sampling rule's key.
    A decode's draw is replayed from a CUDA graph when the target has graphs
    (:meth:`ShardedTarget.on_logits`); a prefill's, once per sequence, runs eagerly."""
    pool = target.shards[-1].caches.pool

    def draw(_: torch.Tensor) -> torch.Tensor:
        return sample_tokens(row, None if sampling.greedy else pool.position[:1], sampling)

    if not decode:
        return int(draw(row))
    return int(target.on_logits("decode", row, row[:0, 0], sampling, draw))
