"""The commands' timing harness: speculative runs against plain target-only greedy.

:func:`dflash.execution.run.generate` times one speculative run; this module times it
against the plain greedy baseline (:func:`dflash.execution.run.timed_greedy`: same model,
shards and CUDA-graph setting, its decode timed the same way), alternating the two
``repeats`` times on the same two targets and reporting the medians and the speed-up, and
it warms the targets and a kept engine up first. ``dflash generate`` uses all of it;
``dflash bench`` times its A/B/A phases' runs and its greedy runs with the same
:meth:`Harness.speculative` and :meth:`Harness.greedy`.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from dflash.execution import run
from dflash.execution.engine import SpecDecoder
from dflash.execution.eos import Eos
from dflash.execution.oracle import greedy_target
from dflash.execution.policy import RollbackPolicy
from dflash.execution.results import GenerationResult, token_sha256
from dflash.execution.shards import DEFAULT_PREFILL_CHUNK, ShardedTarget, ShardPlan
from dflash.execution.window import WindowChoice
from dflash.model import TargetModel
from dflash.model.caches import CaptureKind
from dflash.model.drafters import Drafter
from dflash.sampling import GREEDY, SamplingParams


@dataclass(frozen=True)
class Harness:
    """One command's timed runs: the same model, drafter, prompt, shards and sizes each
    time, on targets kept across the runs when ``target`` / ``greedy_target`` are set
    (their CUDA graphs are then captured once, as a serving process would), else on new
    ones per run."""

    model: TargetModel
    drafter: Drafter
    prompt: list[int]
    plan: ShardPlan
    max_new_tokens: int
    block_size: int
    eos_id: Eos = None
    graphs: bool | None = None
    target: ShardedTarget | None = None  # the speculative runs' (run.spec_target)
    greedy_target: ShardedTarget | None = None  # the plain greedy runs' (oracle.greedy_target)
    verify_window: WindowChoice = "auto"  # every speculative run's (SpecDecoder)
    tree_budget: int | None = None  # every speculative run's (SpecDecoder)
    sampling: SamplingParams = GREEDY  # every run's rule, speculative and plain
    prefill_chunk: int | None = DEFAULT_PREFILL_CHUNK  # every run's, speculative and plain
    # positions the speculative caches hold (None: the prompt, the budget and a block)
    max_context: int | None = None
    on_prefill_chunk: Callable[[int, int], None] | None = None  # the first run's progress

    @classmethod
    def kept(
        cls,
        model: TargetModel,
        drafter: Drafter,
        prompt: Sequence[int],
        plan: ShardPlan,
        *,
        max_new_tokens: int,
        block_size: int,
        eos_id: Eos = None,
        graphs: bool | None = None,
        greedy_tokens: int | None = None,
        verify_window: WindowChoice = "auto",
        capture: CaptureKind = "states",
        tree_budget: int | None = None,
        sampling: SamplingParams = GREEDY,
        prefill_chunk: int | None = DEFAULT_PREFILL_CHUNK,
        max_context: int | None = None,
        on_prefill_chunk: Callable[[int, int], None] | None = None,
    ) -> Harness:
        """A harness with a kept speculative target for these sizes and, when
        ``greedy_tokens`` is given, a kept greedy target for that many tokens. The
        speculative target comes first: it refuses a budget past the model's positions
        (:class:`ContextLengthError`) before anything is allocated."""
        prompt = list(prompt)
        target = run.spec_target(
            model, plan, len(prompt), max_new_tokens, block_size, graphs=graphs, capture=capture,
            tree_budget=tree_budget, prefill_chunk=prefill_chunk, max_context=max_context,
        )
        greedy = None
        if greedy_tokens is not None:
            greedy = greedy_target(model, plan, len(prompt), greedy_tokens, graphs=graphs,
                                   prefill_chunk=prefill_chunk)
        return cls(model, drafter, prompt, plan, max_new_tokens, block_size, eos_id, graphs,
                   target, greedy, verify_window, tree_budget, sampling, prefill_chunk,
                   max_context, on_prefill_chunk)

    def engine(self, policy: RollbackPolicy) -> SpecDecoder:
        """A :class:`SpecDecoder` on the kept target, to pass to every run as ``engine``:
        its capture gate runs in the first of them only (the verdict is sticky)."""
        if self.target is None:
            raise ValueError("a kept engine needs a kept target: build the harness with kept()")
        return SpecDecoder(self.target, self.drafter, block_size=self.block_size, policy=policy,
                           verify_window=self.verify_window, tree_budget=self.tree_budget,
                           sampling=self.sampling)

    def speculative(
        self,
        policy: RollbackPolicy,
        *,
        engine: SpecDecoder | None = None,
        max_new_tokens: int | None = None,
        on_progress: Callable[[int, SpecDecoder], None] | None = None,
        check_parity: bool = False,
        oracle_tokens: Sequence[int] | None = None,
    ) -> GenerationResult:
        """One timed speculative run (:func:`dflash.execution.run.generate`) on the kept
        target; ``max_new_tokens`` (default: the harness's) may be smaller, as a warm-up's."""
        return run.generate(
            self.model,
            self.drafter,
            self.prompt,
            plan=self.plan,
            max_new_tokens=self.max_new_tokens if max_new_tokens is None else max_new_tokens,
            block_size=self.block_size,
            policy=policy,
            eos_id=self.eos_id,
            on_progress=on_progress,
            graphs=self.graphs,
            target=self.target,
            engine=engine,
            check_parity=check_parity,
            oracle_tokens=oracle_tokens,
            verify_window=self.verify_window,
            tree_budget=self.tree_budget,
            sampling=self.sampling,
            prefill_chunk=self.prefill_chunk,
            max_context=self.max_context,
            on_prefill_chunk=self.on_prefill_chunk if on_progress is not None else None,
        )

    def greedy(self, n: int) -> run.GreedyRun:
        """One timed plain greedy decode of ``n`` tokens on the kept greedy target."""
        return run.timed_greedy(
            self.model, self.plan, self.prompt, n, graphs=self.graphs, target=self.greedy_target,
            sampling=self.sampling, prefill_chunk=self.prefill_chunk,
        )

    def warm_up(
        self, policy: RollbackPolicy, engine: SpecDecoder | None, tokens: int, *, baseline: bool
    ) -> None:
        """Two untimed rounds of ``tokens`` tokens (at most the harness's budget): a
        speculative run, then with ``baseline`` a greedy decode of as many tokens. Two,
        because a CUDA graph key's first forward runs eagerly and its second captures;
        with a kept ``engine`` the capture gate runs (and validates fast rollback) in the
        first round, so the timed runs compare steady states. A drafter needs no reset:
        after a prefill the engine hands it the features of the whole prompt, which
        replace any cached context."""
        for _ in range(2):
            warm = self.speculative(
                policy, engine=engine, max_new_tokens=min(tokens, self.max_new_tokens)
            )
            if baseline:
                self.greedy(len(warm.tokens))

    def against_greedy(
        self,
        policy: RollbackPolicy,
        *,
        repeats: int = 1,
        engine: SpecDecoder | None = None,
        on_progress: Callable[[int, SpecDecoder], None] | None = None,
        oracle_tokens: Sequence[int] | None = None,
    ) -> GenerationResult:
        """The speculative decode timed against plain greedy decoding of its tokens.

        Speculative, plain, speculative, plain … ``repeats`` times each, alternately, so
        that a machine whose speed drifts slows both sides alike; the result is the first
        speculative run's (only it streams through ``on_progress``, and its steps and
        reports are the result's) with ``timings`` holding every run's decode seconds,
        the median of each side, their rates and ``speedup_vs_greedy``. ``parity``: the
        first run's tokens against ``oracle_tokens`` when given, else against the first
        greedy run's; every later run of either side must give its side's first tokens.
        ``repeats`` > 1 needs a kept ``engine`` (a long-lived one serves one request
        after another: its capture gate runs once).
        """
        if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
            raise ValueError(f"'repeats' must be an int >= 1 (got {repeats!r})")
        if repeats > 1 and engine is None:
            raise ValueError(f"'repeats'={repeats} share one engine: pass a kept 'engine'")
        first = self.speculative(
            policy, engine=engine, on_progress=on_progress,
            check_parity=oracle_tokens is not None, oracle_tokens=oracle_tokens,
        )
        n = len(first.tokens)
        greedy = self.greedy(n)
        parity, parity_sha = first.parity, first.parity_sha256
        if parity is None:  # no oracle: the baseline's tokens are the reference
            parity, parity_sha = greedy.tokens == first.tokens, token_sha256(greedy.tokens)
        spec_runs, greedy_runs = [first.timings.decode_s], [greedy.decode_s]
        for _ in range(repeats - 1):
            again = self.speculative(policy, engine=engine)
            plain = self.greedy(n)
            spec_runs.append(again.timings.decode_s)
            greedy_runs.append(plain.decode_s)
            if again.tokens != first.tokens or plain.tokens != greedy.tokens:
                parity = False
        decode_s, greedy_s = statistics.median(spec_runs), statistics.median(greedy_runs)
        rate, greedy_rate = run.decode_rate(n, decode_s), run.decode_rate(n, greedy_s)
        timings = first.timings.model_copy(update={
            "decode_s": decode_s,
            "tokens_per_s": rate,
            "greedy_decode_s": greedy_s,
            "greedy_tokens_per_s": greedy_rate,
            "decode_runs_s": spec_runs,
            "greedy_decode_runs_s": greedy_runs,
        })
        return first.model_copy(update={
            "timings": timings,
            "parity": parity,
            "parity_sha256": parity_sha,
            "speedup_vs_greedy": (
                rate / greedy_rate if rate is not None and greedy_rate is not None else None
            ),
        })
