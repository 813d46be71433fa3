"""One generation, start to finish: shards, prefill, the step loop, results, parity."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from dflash.execution.engine import SpecDecoder, StepRecord
from dflash.execution.errors import ContextLengthError
from dflash.execution.faults import FaultInjector
from dflash.execution.oracle import greedy_target as greedy_target_for
from dflash.execution.oracle import reference_greedy
from dflash.execution.policy import RollbackPolicy, RollbackStatus
from dflash.execution.results import (
    CaptureReport,
    GenerationResult,
    RollbackReport,
    Timings,
    token_sha256,
)
from dflash.execution.shards import ShardedTarget, ShardPlan
from dflash.model import TargetModel
from dflash.model.drafters import Drafter, LookupAssistedDrafter


def _sync(plan: ShardPlan) -> None:
    for d in plan.devices:
        if d.startswith("cuda"):
            torch.cuda.synchronize(d)


def decode_rate(n_tokens: int, decode_s: float) -> float | None:
    """Tokens/s of the decode steps: every token but the first (the prefill's) over the
    decode time; None when no decode step ran."""
    return (n_tokens - 1) / decode_s if n_tokens > 1 and decode_s > 0 else None


@dataclass(frozen=True)
class GreedyRun:
    """One plain target-only greedy decode, timed like :func:`generate` times its own."""

    tokens: list[int]
    decode_s: float  # device-synchronised seconds after the prefill's token
    tokens_per_s: float | None  # :func:`decode_rate` of the tokens over ``decode_s``


def timed_greedy(
    model: TargetModel,
    plan: ShardPlan,
    prompt: Sequence[int],
    n: int,
    *,
    graphs: bool | None = None,
    target: ShardedTarget | None = None,
) -> GreedyRun:
    """:func:`reference_greedy` of ``n`` tokens, its decode (after the prefill) timed."""
    marks: list[float] = []

    def prefilled() -> None:
        _sync(plan)
        marks.append(time.perf_counter())

    tokens = reference_greedy(
        model, plan, prompt, n, graphs=graphs, on_prefill=prefilled, target=target
    )
    _sync(plan)
    decode_s = time.perf_counter() - marks[0] if marks else 0.0
    return GreedyRun(tokens, decode_s, decode_rate(len(tokens), decode_s))


@dataclass(frozen=True)
class _Mark:
    """An engine's counters before a generation (a kept engine carries earlier ones)."""

    records: int
    target_forwards: int
    counts: dict[str, int]
    status: RollbackStatus

    @staticmethod
    def of(engine: SpecDecoder) -> _Mark:
        return _Mark(len(engine.records), engine.target_forwards, dict(engine.counts),
                     engine.status)


@dataclass(frozen=True)
class _FirstRun:
    """What a generation's result reports of its first speculative run: the engine's
    steps and counters since ``mark``, taken before the repeats go on with the same
    engine (its records and counters keep growing)."""

    records: tuple[StepRecord, ...]
    target_forwards: int
    counts: dict[str, int]
    status: RollbackStatus
    status_at_start: RollbackStatus
    fast_unavailable_reason: str | None
    capture: CaptureReport

    @staticmethod
    def of(engine: SpecDecoder, mark: _Mark) -> _FirstRun:
        return _FirstRun(
            records=tuple(engine.records[mark.records :]),
            target_forwards=engine.target_forwards - mark.target_forwards,
            counts={k: v - mark.counts[k] for k, v in engine.counts.items()},
            status=engine.status,
            status_at_start=mark.status,
            fast_unavailable_reason=engine.fast_unavailable_reason,
            capture=engine.gate.report,
        )


def spec_capacity(prompt_len: int, max_new_tokens: int, block_size: int) -> int:
    """KV positions the target of a :func:`generate` run holds."""
    return prompt_len + max_new_tokens + block_size + 1


def spec_target(
    model: TargetModel,
    plan: ShardPlan,
    prompt_len: int,
    max_new_tokens: int,
    block_size: int,
    *,
    graphs: bool | None = None,
    windows: bool = True,
) -> ShardedTarget:
    """A target for :func:`generate` runs of these sizes (keep it and pass it as
    ``target=`` to run again without new CUDA graphs); ``windows``: see
    :class:`ShardedTarget`."""
    return ShardedTarget(model, plan, max_len=spec_capacity(prompt_len, max_new_tokens, block_size),
                         max_draft=block_size, graphs=graphs, windows=windows)


def positions_needed(prompt_len: int, max_new_tokens: int, block_size: int) -> int:
    """Positions a run may write: the last verify starts at most at position
    ``prompt_len + max_new_tokens - 2`` and covers ``block_size`` of them."""
    return prompt_len + max_new_tokens + block_size - 2


def check_positions(
    model: TargetModel, prompt_len: int, max_new_tokens: int, block_size: int
) -> None:
    """Refuse, before any decoding, a budget past the model's ``max_position_embeddings``."""
    need = positions_needed(prompt_len, max_new_tokens, block_size)
    limit = model.config.max_position_embeddings
    if need > limit:
        raise ContextLengthError(
            f"prompt of {prompt_len} tokens + max_new_tokens={max_new_tokens} + "
            f"block_size={block_size} - 2 = {need} positions exceed the model's "
            f"max_position_embeddings={limit}"
        )


def _speculative_run(
    engine: SpecDecoder,
    prompt: Sequence[int],
    plan: ShardPlan,
    max_new_tokens: int,
    eos_id: int | None,
    on_progress: Callable[[int, SpecDecoder], None] | None,
) -> tuple[list[int], str, tuple[float, float, float]]:
    """One speculative decode on ``engine`` (its prefill starts a new generation):
    (tokens, stop reason, (start, after the prefill, end) as device-synchronised
    ``perf_counter`` times)."""
    _sync(plan)
    t0 = time.perf_counter()
    out = [engine.prefill(prompt)]
    _sync(plan)
    t1 = time.perf_counter()
    stop = "max_new_tokens"
    saw_eos = eos_id is not None and out[0] == eos_id
    while len(out) < max_new_tokens and not saw_eos:
        emitted = engine.step()
        out.extend(emitted)
        saw_eos = eos_id is not None and eos_id in emitted
        if on_progress is not None:
            on_progress(min(len(out), max_new_tokens), engine)
    _sync(plan)
    t2 = time.perf_counter()
    if eos_id is not None and eos_id in out[:max_new_tokens]:
        out, stop = out[: out.index(eos_id) + 1], "eos"
    return out[:max_new_tokens], stop, (t0, t1, t2)


def _check_engine(
    engine: SpecDecoder,
    target: ShardedTarget | None,
    drafter: Drafter,
    block_size: int,
    policy: RollbackPolicy,
    faults: FaultInjector | None,
) -> None:
    """``ValueError`` naming why a kept ``engine`` cannot run this generation."""
    if not isinstance(engine, SpecDecoder):
        raise ValueError(f"'engine' must be a SpecDecoder (got {type(engine).__name__})")
    problems = []
    if target is None or engine.target is not target:
        problems.append("it runs on another target (pass the engine's target as 'target')")
    if engine.drafter is not drafter:
        problems.append(f"it drafts with another drafter ({engine.drafter.label!r})")
    if engine.block_size != block_size:
        problems.append(f"its block size is {engine.block_size}, not {block_size}")
    if engine.policy != policy:
        problems.append(f"its rollback mode is {engine.policy.mode!r}, not {policy.mode!r}")
    if faults is not None:
        problems.append("a run with 'faults' gets a new engine and target")
    if problems:
        raise ValueError(f"the kept engine cannot run this generation: {'; '.join(problems)}")


def generate(
    model: TargetModel,
    drafter: Drafter,
    prompt: Sequence[int],
    *,
    plan: ShardPlan,
    max_new_tokens: int = 64,
    block_size: int = 16,
    policy: RollbackPolicy | None = None,
    check_parity: bool = False,
    oracle_tokens: Sequence[int] | None = None,
    eos_id: int | None = None,
    faults: FaultInjector | None = None,
    on_progress: Callable[[int, SpecDecoder], None] | None = None,
    graphs: bool | None = None,
    baseline: bool = False,
    target: ShardedTarget | None = None,
    greedy_target: ShardedTarget | None = None,
    repeats: int = 1,
    engine: SpecDecoder | None = None,
) -> GenerationResult:
    """Speculative greedy decoding of ``max_new_tokens`` tokens after ``prompt``.

    ``oracle_tokens``: target-only greedy tokens already computed with the same settings
    (reused by ``check_parity`` instead of decoding them again). ``graphs``: CUDA graphs
    for the decode-time forwards (None: wherever supported; False: eager). ``baseline``:
    afterwards decode the same number of tokens with plain target-only greedy
    (:func:`timed_greedy`, same shards and ``graphs``) and report its rate and the
    speed-up over it, and its tokens are compared with the speculative ones (``parity``);
    ``check_parity`` compares against that same run (or decodes one) unless
    ``oracle_tokens`` are given. ``target`` / ``greedy_target``: a :class:`ShardedTarget`
    kept across calls for the speculative run / the greedy baseline (its CUDA graphs are
    then captured once, not per call); it must serve this model, plan, length and block
    size (:meth:`ShardedTarget.cannot_serve`), else ``ValueError`` names why. Runs with
    ``faults`` always get a fresh target.

    ``repeats`` (with ``baseline``): time both decodes ``repeats`` times, alternately —
    speculative, plain, speculative, plain … on the same two targets — and report the
    median rate of each (``timings`` keeps every run's); a machine whose speed drifts
    then slows both sides alike. The speculative runs share one engine, as a long-lived
    one serves one request after another: its capture gate runs in the first run only (a
    verdict is sticky for the engine's lifetime), so the others roll back fast from
    their first step. Every speculative run must give the first one's tokens (``parity``
    is false otherwise); only the first streams (``on_progress``) and sets the step
    statistics and the rollback and capture reports. With one repeat the order is the
    same, speculative first. With ``faults`` the repeats run on a new engine without them.

    ``engine``: a :class:`SpecDecoder` kept across calls, as ``target`` is (it must run
    on ``target`` with ``drafter``, ``block_size`` and ``policy``, and takes no
    ``faults``; else ``ValueError`` names the difference): its capture gate's verdict
    carries over (it is sticky for the engine's lifetime), so a generation after the one
    that validated it rolls back fast from its first step. The result reports this
    call's steps and rollbacks only; ``rollback.status_at_start`` is the engine's status
    when this generation began, and ``capture`` the engine's report (``validated_at_step``
    counts the engine's steps since it was built).
    """
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"'repeats' must be an int >= 1 (got {repeats!r})")
    if repeats > 1 and not baseline:
        raise ValueError(f"'repeats'={repeats} times the baseline too: it needs baseline=True")
    if (
        isinstance(max_new_tokens, bool)
        or not isinstance(max_new_tokens, int)
        or max_new_tokens < 1
    ):
        raise ValueError(f"'max_new_tokens' must be an int >= 1 (got {max_new_tokens!r})")
    check_positions(model, len(prompt), max_new_tokens, block_size)
    policy = policy or RollbackPolicy()
    if engine is not None:
        _check_engine(engine, target, drafter, block_size, policy, faults)
    if target is None or faults is not None:
        target = spec_target(model, plan, len(prompt), max_new_tokens, block_size, graphs=graphs)
    else:
        target.require_serves(
            model, plan, max_len=spec_capacity(len(prompt), max_new_tokens, block_size),
            max_draft=block_size, graphs=graphs, what="generation",
        )
    if engine is None:
        engine = SpecDecoder(target, drafter, block_size=block_size, policy=policy, faults=faults)
    mark = _Mark.of(engine)
    tokens, stop, (t0, t1, t2) = _speculative_run(
        engine, prompt, plan, max_new_tokens, eos_id, on_progress
    )
    copied = drafter.copied_drafts if isinstance(drafter, LookupAssistedDrafter) else None
    ref = None if oracle_tokens is None else list(oracle_tokens)
    greedy: GreedyRun | None = None
    if baseline or (check_parity and ref is None):  # one greedy decode serves both
        if greedy_target is None and repeats > 1:  # the repeats reuse one greedy target
            greedy_target = greedy_target_for(model, plan, len(prompt), len(tokens), graphs=graphs)
        greedy = timed_greedy(
            model, plan, prompt, len(tokens), graphs=graphs, target=greedy_target
        )
        ref = greedy.tokens if ref is None else ref
    parity: bool | None = None
    parity_sha: str | None = None
    if (check_parity or greedy is not None) and ref is not None:  # a baseline is free parity
        parity = ref[: len(tokens)] == tokens
        parity_sha = token_sha256(ref[: len(tokens)])
    first = _FirstRun.of(engine, mark)  # the repeats go on with the same engine
    spec_runs = [t2 - t1]
    greedy_runs = [] if greedy is None else [greedy.decode_s]
    again_on = engine if faults is None or repeats == 1 else (  # the repeats: no faults
        SpecDecoder(target, drafter, block_size=block_size, policy=policy)
    )
    for _ in range(repeats - 1):
        again, _, (_, s1, s2) = _speculative_run(
            again_on, prompt, plan, max_new_tokens, eos_id, None
        )
        plain = timed_greedy(model, plan, prompt, len(tokens), graphs=graphs,
                             target=greedy_target)
        spec_runs.append(s2 - s1)
        greedy_runs.append(plain.decode_s)
        if again != tokens or (greedy is not None and plain.tokens != greedy.tokens):
            parity = False
    records = first.records
    steps = len(records)
    drafted = sum(len(r.draft) - 1 for r in records)  # the verified guesses
    accepted = sum(r.accept_n - 1 for r in records)
    decode_s = statistics.median(spec_runs)
    rate = decode_rate(len(tokens), decode_s)
    greedy_s = statistics.median(greedy_runs) if baseline and greedy_runs else None
    greedy_rate = None if greedy_s is None else decode_rate(len(tokens), greedy_s)
    effective = [r for r in records if r.status_before is RollbackStatus.EFFECTIVE]
    return GenerationResult(
        tokens=tokens,
        sha256=token_sha256(tokens),
        steps=steps,
        acceptance_rate=accepted / drafted if drafted else 0.0,
        avg_commit=(sum(r.accept_n for r in records) / steps) if steps else 0.0,
        target_forwards_per_step=first.target_forwards / steps if steps else 0.0,
        rollback=RollbackReport(
            requested=policy.mode,
            status=first.status,
            status_at_start=first.status_at_start,
            fast_unavailable_reason=first.fast_unavailable_reason,
            fast=first.counts["fast"],
            replay=first.counts["replay"],
            replay_after_failure=first.counts["replay_after_failure"],
            poison_events=first.counts["poison_events"],
        ),
        capture=first.capture,
        checkpoint_bytes=target.checkpoint_bytes,
        parity=parity,
        timings=Timings(
            prefill_s=t1 - t0,
            decode_s=decode_s,
            tokens_per_s=rate,
            greedy_decode_s=greedy_s,
            greedy_tokens_per_s=greedy_rate,
            decode_runs_s=spec_runs,
            greedy_decode_runs_s=greedy_runs if baseline else [],
        ),
        prompt_len=len(prompt),
        block_size=block_size,
        devices=list(plan.devices),
        layer_split=list(plan.split),
        drafter=drafter.label,
        stop_reason=stop,  # type: ignore[arg-type]  # one of the two literals above
        target_forwards=first.target_forwards,
        effective_forwards_per_step=(
            sum(r.forwards for r in effective) / len(effective) if effective else None
        ),
        drafted_tokens=drafted,
        accepted_tokens=accepted,
        copied_drafts=copied,
        parity_sha256=parity_sha,
        speedup_vs_greedy=(
            rate / greedy_rate if rate is not None and greedy_rate is not None else None
        ),
    )
