"""One generation, start to finish: shards, prefill, the step loop, results, parity."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from dflash.execution.engine import SpecDecoder, StepRecord
from dflash.execution.eos import Eos, cut_at_eos, eos_set
from dflash.execution.errors import ContextLengthError
from dflash.execution.faults import FaultInjector
from dflash.execution.oracle import reference_greedy
from dflash.execution.policy import RollbackPolicy, RollbackStatus
from dflash.execution.prefix import PrefixCache
from dflash.execution.results import (
    GenerationResult,
    RollbackReport,
    Timings,
    token_sha256,
)
from dflash.execution.shards import DEFAULT_PREFILL_CHUNK, ShardedTarget, ShardPlan
from dflash.execution.window import WindowChoice
from dflash.model import TargetModel
from dflash.model.caches import CaptureKind, capture_kind
from dflash.model.drafters import Drafter, LookupAssistedDrafter
from dflash.sampling import GREEDY, SamplingParams


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
    sampling: SamplingParams = GREEDY,
    prefill_chunk: int | None = DEFAULT_PREFILL_CHUNK,
) -> GreedyRun:
    """:func:`reference_greedy` of ``n`` tokens (under ``sampling``), its decode (after
    the prefill) timed."""
    marks: list[float] = []

    def prefilled() -> None:
        _sync(plan)
        marks.append(time.perf_counter())

    tokens = reference_greedy(
        model, plan, prompt, n, graphs=graphs, on_prefill=prefilled, target=target,
        sampling=sampling, prefill_chunk=prefill_chunk,
    )
    _sync(plan)
    decode_s = time.perf_counter() - marks[0] if marks else 0.0
    return GreedyRun(tokens, decode_s, decode_rate(len(tokens), decode_s))


@dataclass(frozen=True)
class _Before:
    """An engine's counters when a generation starts. A kept engine carries earlier
    generations' steps and counts; a result reports the difference, this call's alone."""

    records: int
    target_forwards: int
    counts: dict[str, int]
    status: RollbackStatus

    @staticmethod
    def of(engine: SpecDecoder) -> _Before:
        return _Before(len(engine.records), engine.target_forwards, dict(engine.counts),
                       engine.status)

    def steps(self, engine: SpecDecoder) -> list[StepRecord]:
        return engine.records[self.records :]

    def forwards(self, engine: SpecDecoder) -> int:
        return engine.target_forwards - self.target_forwards

    def counted(self, engine: SpecDecoder, what: str) -> int:
        return engine.counts[what] - self.counts[what]


def spec_capacity(
    prompt_len: int, max_new_tokens: int, block_size: int, max_context: int | None = None
) -> int:
    """KV positions the target of a :func:`generate` run holds: the prompt, the budget and
    a block past it, or ``max_context`` tokens and a block (a context sized in advance)."""
    tokens = prompt_len + max_new_tokens if max_context is None else max_context
    return tokens + block_size + 1


def spec_target(
    model: TargetModel,
    plan: ShardPlan,
    prompt_len: int,
    max_new_tokens: int,
    block_size: int,
    *,
    graphs: bool | None = None,
    capture: CaptureKind = "states",
    tree_budget: int | None = None,
    prefill_chunk: int | None = DEFAULT_PREFILL_CHUNK,
    max_context: int | None = None,
) -> ShardedTarget:
    """A target for :func:`generate` runs of these sizes (keep it and pass it as
    ``target=`` to run again without new CUDA graphs), capturing what the rollback mode
    needs (:func:`dflash.model.caches.capture_kind`; an engine rebuilds the storage for
    another mode). Sizes past the model's positions are refused before anything is
    allocated (:func:`check_positions`)."""
    slots = verify_slots(block_size, tree_budget)
    check_positions(model, prompt_len, max_new_tokens, slots, max_context)
    return ShardedTarget(model, plan,
                         max_len=spec_capacity(prompt_len, max_new_tokens, slots, max_context),
                         max_draft=slots, graphs=graphs, capture=capture,
                         trees=tree_budget is not None, prefill_chunk=prefill_chunk)


def verify_slots(block_size: int, tree_budget: int | None) -> int:
    """Slots a verify may write: the block, or a tree of ``tree_budget`` nodes if larger."""
    return max(block_size, tree_budget or 0)


def positions_needed(prompt_len: int, max_new_tokens: int, block_size: int) -> int:
    """Positions a run may write: the last verify starts at most at position
    ``prompt_len + max_new_tokens - 2`` and covers ``block_size`` of them (plain decoding:
    ``block_size`` 1, the last token is never fed back)."""
    return prompt_len + max_new_tokens + block_size - 2


def check_positions(
    model: TargetModel, prompt_len: int, max_new_tokens: int, block_size: int,
    max_context: int | None = None,
) -> None:
    """Refuse, before any decoding, a budget past the model's ``max_position_embeddings``
    or past ``max_context`` (which the model's positions must cover too)."""
    need = positions_needed(prompt_len, max_new_tokens, block_size)
    limit = model.config.max_position_embeddings
    if max_context is not None:
        if isinstance(max_context, bool) or not isinstance(max_context, int) or not (
            1 <= max_context <= limit
        ):
            raise ContextLengthError(
                f"'max_context' must be an int in [1, max_position_embeddings={limit}] "
                f"(got {max_context!r})"
            )
        if prompt_len + max_new_tokens > max_context:
            raise ContextLengthError(
                f"prompt of {prompt_len} tokens + max_new_tokens={max_new_tokens} = "
                f"{prompt_len + max_new_tokens} tokens exceed max_context={max_context}"
            )
    if need > limit:
        verify = (f" - 1 = {need} positions" if block_size == 1 else
                  f" + a last verify of {block_size} slots - 2 = {need} positions")
        raise ContextLengthError(
            f"prompt of {prompt_len} tokens + max_new_tokens={max_new_tokens}{verify} "
            f"exceed the model's max_position_embeddings={limit}"
            + _fit(limit - prompt_len - block_size + 2)
        )


def _fit(room: int) -> str:
    return " (the prompt leaves no room)" if room < 1 else f" (at most {room} new tokens fit)"


def _speculative_run(
    engine: SpecDecoder,
    prompt: Sequence[int],
    plan: ShardPlan,
    max_new_tokens: int,
    eos_id: Eos,
    on_progress: Callable[[int, SpecDecoder], None] | None,
    stop_when: Callable[[], bool] | None = None,
    on_prefill_chunk: Callable[[int, int], None] | None = None,
    reuse: bool = False,
    cache: PrefixCache | None = None,
) -> tuple[list[int], str, tuple[float, float, float]]:
    """One speculative decode on ``engine`` (its prefill starts a new generation):
    (tokens, stop reason, (start, after the prefill, end) as device-synchronised
    ``perf_counter`` times). ``stop_when()``, asked after every step's ``on_progress``,
    ends the decode early (stop reason ``"stop"``)."""
    _sync(plan)
    t0 = time.perf_counter()
    out = [engine.prefill(prompt, reuse=reuse, cache=cache, on_chunk=on_prefill_chunk)]
    _sync(plan)
    t1 = time.perf_counter()
    stop = "max_new_tokens"
    eos = eos_set(eos_id)
    saw_eos = out[0] in eos
    while len(out) < max_new_tokens and not saw_eos:
        emitted = engine.step()
        out.extend(emitted)
        saw_eos = not eos.isdisjoint(emitted)
        if on_progress is not None:
            on_progress(min(len(out), max_new_tokens), engine)
        if stop_when is not None and stop_when():
            stop = "stop"
            break
    _sync(plan)
    t2 = time.perf_counter()
    cut = cut_at_eos(out[:max_new_tokens], eos)
    if cut is not None:
        out, stop = cut, "eos"
    return out[:max_new_tokens], stop, (t0, t1, t2)


def _check_engine(
    engine: SpecDecoder,
    target: ShardedTarget | None,
    drafter: Drafter,
    block_size: int,
    policy: RollbackPolicy,
    faults: FaultInjector | None,
    verify_window: WindowChoice,
    sampling: SamplingParams,
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
    if engine.verify_window != verify_window:
        problems.append(f"its verify window is {engine.verify_window!r}, not {verify_window!r}")
    if engine.sampling != sampling:
        problems.append(f"it samples with {engine.sampling}, not {sampling}")
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
    eos_id: Eos = None,
    faults: FaultInjector | None = None,
    on_progress: Callable[[int, SpecDecoder], None] | None = None,
    graphs: bool | None = None,
    target: ShardedTarget | None = None,
    engine: SpecDecoder | None = None,
    check_parity: bool = False,
    oracle_tokens: Sequence[int] | None = None,
    verify_window: WindowChoice = "auto",
    stop_when: Callable[[], bool] | None = None,
    tree_budget: int | None = None,
    sampling: SamplingParams = GREEDY,
    prefill_chunk: int | None = DEFAULT_PREFILL_CHUNK,
    on_prefill_chunk: Callable[[int, int], None] | None = None,
    reuse: bool = False,
    max_context: int | None = None,
    prefix_cache: PrefixCache | None = None,
) -> GenerationResult:
    """Speculative decoding of ``max_new_tokens`` tokens after ``prompt`` (greedy, or
    drawn by ``sampling``'s seeded rule, :mod:`dflash.sampling`): one run, its prefill
    and its decode timed (device-synchronised), its step statistics and its rollback and
    capture reports.

    ``check_parity``: compare the tokens with plain target-only decoding under the same
    rule, ``oracle_tokens`` when given (tokens already computed with the same settings),
    else a :func:`reference_greedy` decode of the same number of tokens (untimed).
    ``graphs``: CUDA graphs for the decode-time forwards (None: wherever supported;
    False: eager). ``on_progress(tokens so far, engine)``: called after every step;
    ``stop_when()``: asked after it, ends the decode early when true (``stop_reason``
    ``"stop"``; the caller decides what is cut, e.g. at a stop string). ``eos_id``: the
    decode ends at the step that commits any of these ids (one, several, or None), the
    tokens cut after it (``stop_reason`` ``"eos"``).
    ``verify_window``: how much of each draft a step verifies (:class:`SpecDecoder`).
    ``tree_budget``: tree drafts of at most that many nodes (a :class:`TreeDrafter`;
    :class:`SpecDecoder`); the target then holds ``max(block_size, tree_budget)`` slots.
    A budget past the model's ``max_position_embeddings`` is refused before anything is
    built (:class:`ContextLengthError`). ``prefill_chunk``: tokens per prefill forward
    (None: the whole prompt in one), the oracle's too; ``on_prefill_chunk(done, total)``
    after each chunk (a progress display). ``reuse`` (with a kept ``engine``): when the
    engine's caches hold a proper prefix of ``prompt`` (the previous generation's prompt
    and committed output), only the rest is prefilled (:meth:`SpecDecoder.prefill`);
    ``cached_tokens`` reports how many were kept. ``prefix_cache``: a
    :class:`~dflash.execution.prefix.PrefixCache` of ``target``: the longest cached prefix
    of ``prompt`` is restored instead of prefilled, the prompt's own cached, the output
    the same bits as without it. ``max_context``: the target (a new one)
    holds that many tokens and a block, whatever this run needs (a prompt plus budget past
    it is refused, :class:`ContextLengthError`).

    ``target``: a :class:`ShardedTarget` kept across calls (:func:`spec_target`; its CUDA
    graphs are then captured once, not per call); it must serve this model, plan, length
    and block size (:meth:`ShardedTarget.cannot_serve`), else ``ValueError`` names why.
    Runs with ``faults`` always get a fresh target.

    ``engine``: a :class:`SpecDecoder` kept across calls, as ``target`` is (it must run
    on ``target`` with ``drafter``, ``block_size``, ``policy`` and ``verify_window``, and
    takes no ``faults``; else ``ValueError`` names the difference): its capture gate's verdict
    carries over (it is sticky for the engine's lifetime), so a generation after the one
    that validated it rolls back fast from its first step. The result reports this
    call's steps and rollbacks only; ``rollback.status_at_start`` is the engine's status
    when this generation began, and ``capture`` the engine's report (``validated_at_step``
    counts the engine's steps since it was built).

    The plain greedy baseline, repeated timings and the speed-up over greedy are the
    CLI's (``dflash.commands.harness``); they fill this result's ``timings.greedy_*``,
    ``decode_runs_s`` and ``speedup_vs_greedy``, which a single run leaves empty.
    """
    if (
        isinstance(max_new_tokens, bool)
        or not isinstance(max_new_tokens, int)
        or max_new_tokens < 1
    ):
        raise ValueError(f"'max_new_tokens' must be an int >= 1 (got {max_new_tokens!r})")
    policy = policy or RollbackPolicy()
    if engine is not None:
        _check_engine(
            engine, target, drafter, block_size, policy, faults, verify_window, sampling
        )

        if engine.tree_budget != tree_budget:
            raise ValueError(
                f"'engine' drafts trees of {engine.tree_budget} nodes, not {tree_budget}"
            )
    slots = verify_slots(block_size, tree_budget)
    if target is None or faults is not None:  # spec_target checks the positions
        target = spec_target(model, plan, len(prompt), max_new_tokens, block_size, graphs=graphs,
                             capture=capture_kind(policy.mode), tree_budget=tree_budget,
                             prefill_chunk=prefill_chunk, max_context=max_context)
    else:
        check_positions(model, len(prompt), max_new_tokens, slots, max_context)
        target.require_serves(
            model, plan, max_len=spec_capacity(len(prompt), max_new_tokens, slots),
            max_draft=slots, graphs=graphs, what="generation", prefill_chunk=prefill_chunk,
        )
    if engine is None:
        engine = SpecDecoder(target, drafter, block_size=block_size, policy=policy, faults=faults,
                             verify_window=verify_window, tree_budget=tree_budget,
                             sampling=sampling)
    engine.records.clear()   # a kept engine holds this generation's steps only
    before = _Before.of(engine)
    tokens, stop, (t0, t1, t2) = _speculative_run(
        engine, prompt, plan, max_new_tokens, eos_id, on_progress, stop_when, on_prefill_chunk,
        reuse, prefix_cache,
    )
    copied = drafter.copied_drafts if isinstance(drafter, LookupAssistedDrafter) else None
    parity: bool | None = None
    parity_sha: str | None = None
    if check_parity:
        ref = (
            reference_greedy(model, plan, prompt, len(tokens), graphs=graphs, sampling=sampling,
                             prefill_chunk=prefill_chunk)
            if oracle_tokens is None
            else list(oracle_tokens)[: len(tokens)]
        )
        parity, parity_sha = ref == tokens, token_sha256(ref)
    records = before.steps(engine)
    steps = len(records)
    forwards = before.forwards(engine)
    drafted = sum(r.nodes - 1 for r in records)  # the verified guesses (a tree: its nodes)
    accepted = sum(r.accept_n - 1 for r in records)
    decode_s = t2 - t1
    effective = [r for r in records if r.status_before is RollbackStatus.EFFECTIVE]
    return GenerationResult(
        tokens=tokens,
        sha256=token_sha256(tokens),
        steps=steps,
        acceptance_rate=accepted / drafted if drafted else 0.0,
        avg_commit=(sum(r.accept_n for r in records) / steps) if steps else 0.0,
        target_forwards_per_step=forwards / steps if steps else 0.0,
        rollback=RollbackReport(
            requested=policy.mode,
            status=engine.status,
            status_at_start=before.status,
            fast_unavailable_reason=engine.fast_unavailable_reason,
            fast=before.counted(engine, "fast"),
            replay=before.counted(engine, "replay"),
            replay_after_failure=before.counted(engine, "replay_after_failure"),
            poison_events=before.counted(engine, "poison_events"),
        ),
        capture=engine.gate.report,
        checkpoint_bytes=target.checkpoint_bytes,
        capture_bytes=target.capture_bytes,
        tree_budget=tree_budget,
        sampling=None if sampling.greedy else dataclasses.asdict(sampling),
        nodes_per_step=(sum(r.nodes for r in records) / steps) if steps else None,
        parity=parity,
        timings=Timings(
            prefill_s=t1 - t0,
            prefill_tokens_per_s=(len(prompt) - engine.reused) / (t1 - t0) if t1 > t0 else None,
            decode_s=decode_s,
            tokens_per_s=decode_rate(len(tokens), decode_s),
            decode_runs_s=[decode_s],
        ),
        prompt_len=len(prompt),
        cached_tokens=engine.reused,
        block_size=block_size,
        devices=list(plan.devices),
        layer_split=list(plan.split),
        drafter=drafter.label,
        stop_reason=stop,  # type: ignore[arg-type]  # one of the literals _speculative_run sets
        target_forwards=forwards,
        effective_forwards_per_step=(
            sum(r.forwards for r in effective) / len(effective) if effective else None
        ),
        drafted_tokens=drafted,
        accepted_tokens=accepted,
        copied_drafts=copied,
        parity_sha256=parity_sha,
    )
