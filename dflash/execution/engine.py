"""The chain speculative decoding step with a fail-closed rollback.

One step, with ``committed`` tokens in the caches and ``last`` the pending token, in data
order (:meth:`SpecDecoder.step`)::

    draft     d = [last, *guesses[:T-1]]              # d: [T], T the verify window
    validate  geometry = chain_of(T)                  # a validated pure chain, or no verify
    verify    t = argmax(target(d))                   # t[i]: the target's token after d[0..i]
    accept    accept_n = 1 + #leading i with d[i+1] == t[i]
              emit d[1..accept_n-1] and t[accept_n-1];  commit_n = accept_n
    roll back to commit_n                             # fast (checkpoint / remap) or replay
    commit    context += d[:commit_n];  last = t[commit_n-1]

What varies is chosen once, when the engine is built, and wrapped around that step:

- where guesses come from (:mod:`dflash.execution.drafts`: the host, or the device inside
  the step's CUDA graphs, read back with the step's tokens);
- how much of a draft is verified (:mod:`dflash.execution.window`: ``full``, or on CPU the
  window the cost model says pays; lossless either way);
- the capture gate (:mod:`dflash.execution.capture_gate`): while a fast mode is requested
  and not yet judged, a step is the gate's step instead (the whole block verified on
  poisoned storage, the evidence judged, the rollback through replay and the one-time
  self-test);
- fault injection (:mod:`dflash.execution.faults`), which fires inside the rollback owner.

The rollback itself belongs to :mod:`dflash.execution.rollback`: the fast path runs only
while the status is ``effective`` (the gate validated the storage and nothing is
poisoned); a failure inside it after state began to change poisons the target and the
step completes through the legacy path (``replay_after_failure``). Capture storage that
could not be allocated keeps a fast mode ``requested`` and every step on replay.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol, cast

import torch
from torch import Tensor

from dflash.execution.capture_gate import CaptureGate
from dflash.execution.drafts import (
    DeviceDrafts,
    DraftSource,
    HostDrafts,
    draft_source,
)
from dflash.execution.errors import ExecutionError
from dflash.execution.faults import NO_FAULTS, FaultInjector
from dflash.execution.policy import RollbackPolicy, RollbackStatus, parse_mode
from dflash.execution.prefix import PrefixCache, prefill_through
from dflash.execution.rollback import Lifecycle, Rollback, RollbackPath
from dflash.execution.shards import ShardedTarget, device_ids
from dflash.execution.window import VerifyWindow, WindowChoice, make_window
from dflash.geometry import ChainGeometry, TreeGeometry, require_chain, require_tree
from dflash.model.caches import capture_kind
from dflash.model.drafters import DeviceDrafter, Drafter, LookupAssistedDrafter
from dflash.model.drafters.base import CoupledDrafter
from dflash.model.drafters.dflash2_drafter import DFlash2Drafter
from dflash.model.drafters.trees import (
    BranchDrafter,
    CandidateDrafter,
    DraftTree,
    TreeDrafter,
    accept_tree,
    best_first_tree,
)
from dflash.model.tree_device import accept_tree_device
from dflash.sampling import GREEDY, SamplingParams, sample_tokens


@dataclass(frozen=True)
class StepRecord:
    """One step as it happened (for results, tests and the state-machine reference)."""

    step: int
    draft: tuple[int, ...]
    accept_n: int
    emitted: tuple[int, ...]
    path: RollbackPath
    status_before: RollbackStatus
    forwards: int  # target forwards this step (verify + replays; the gate step has one more)
    failure: str | None = None
    nodes: int = 0  # slots verified (a chain: len(draft); a tree: its nodes, draft its path)


@dataclass(frozen=True)
class Verified:
    """A verify's outcome once read back: the draft ``d`` ``[T]``, the target's tokens
    ``t`` ``[T]``, the accepted count, the verify's taps (on the device) and the status
    the step began with."""

    d: list[int]
    t: list[int]
    commit_n: int
    taps: dict[int, Tensor]
    status_before: RollbackStatus
    nodes: int = 0  # slots verified; a tree's ``d`` / ``t`` are its accepted path's

    @property
    def emitted(self) -> list[int]:
        return [*self.d[1 : self.commit_n], self.t[self.commit_n - 1]]


@functools.cache  # immutable once validated: every step of a generation verifies one length
def chain_of(n: int) -> ChainGeometry:
    """The validated pure chain of ``n`` slots; :func:`require_chain` raises on anything else."""
    return require_chain(tuple(range(-1, n - 1)))


@dataclass(frozen=True)
class Draft:
    """What a verify runs on: ``tokens`` ``d`` ``[T]`` (``d[0]`` the pending token) and
    their validated geometry (a chain of ``T`` slots, or a tree of ``T`` nodes)."""

    tokens: list[int]
    geometry: ChainGeometry | TreeGeometry


def leading_count(t: Tensor, draft: Tensor) -> Tensor:
    """On the device: ``t: [T]`` the target's tokens, ``draft: [T]`` int64 →
    ``accept_n: [1]`` = 1 + #leading ``i`` with ``draft[i+1] == t[i]``. A chain accepts
    slots ``0 … accept_n-1``."""
    hits = (draft[1:] == t[:-1]).to(torch.int64)  # [T-1]
    return 1 + torch.cumprod(hits, 0).sum(0, keepdim=True)


def leading_accepted(d: Sequence[int], t: Sequence[int]) -> int:
    """The same count on the host, from the read-back tokens (a cross-check)."""
    accept_n = 1
    while accept_n < len(d) and d[accept_n] == t[accept_n - 1]:
        accept_n += 1
    return accept_n


class AcceptanceRule(Protocol):
    """Which draft tokens the target accepts: on the device before the step's one read
    (``t: [T]`` the target's tokens at the rows' absolute ``positions``, ``count: [1]`` the
    accepted slots), and the same count recomputed on the host from the tokens read back."""

    def tokens(self, logits: Tensor, positions: Tensor | None) -> Tensor: ...

    def on_device(
        self, logits: Tensor, draft: Tensor, positions: Tensor | None
    ) -> tuple[Tensor, Tensor]: ...

    def on_host(self, d: Sequence[int], t: Sequence[int]) -> int: ...


@dataclass(frozen=True)
class TokenAcceptance:
    """The target's token at every row is the sampling rule's (:mod:`dflash.sampling`:
    greedy at temperature 0, else the seeded Gumbel draw at the row's absolute position);
    a chain accepts its leading matches, a tree the deepest confirmed path. Plain decoding
    under the same rule draws the same tokens, so the output is its output."""

    params: SamplingParams = GREEDY

    def tokens(self, logits: Tensor, positions: Tensor | None) -> Tensor:
        """``logits: [T, vocab]`` whose rows draw the tokens at ``positions: [T]`` (None
        when greedy) → ``[T]`` int64 (device)."""
        return sample_tokens(logits, positions, self.params)

    def on_device(
        self, logits: Tensor, draft: Tensor, positions: Tensor | None
    ) -> tuple[Tensor, Tensor]:
        t = self.tokens(logits, positions)
        return t, leading_count(t, draft)

    def on_host(self, d: Sequence[int], t: Sequence[int]) -> int:
        return leading_accepted(d, t)


def self_test_tolerance(dtype: torch.dtype) -> float:
    """Relative error allowed between a checkpoint slot and its replay."""
    return 1e-4 if dtype in (torch.float32, torch.float64) else 5e-2


class SpecDecoder:
    """Speculative decoding on a :class:`ShardedTarget`: chains, or trees of at most
    ``tree_budget`` nodes; the target's tokens drawn by ``sampling``'s rule (greedy by
    default; :mod:`dflash.sampling`), so the output is plain decoding's under that rule.

    ``verify_window``: ``"auto"`` (on an all-CPU target the window the cost model says
    pays, else the whole draft) or ``"full"`` (every draft whole); see
    :mod:`dflash.execution.window`.
    """

    def __init__(
        self,
        target: ShardedTarget,
        drafter: Drafter,
        *,
        block_size: int = 16,
        policy: RollbackPolicy | None = None,
        faults: FaultInjector | None = None,
        verify_window: WindowChoice = "auto",
        tree_budget: int | None = None,
        sampling: SamplingParams = GREEDY,
    ) -> None:
        if not isinstance(sampling, SamplingParams):
            raise ValueError(
                f"'sampling' must be a SamplingParams (got {type(sampling).__name__})"
            )
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 2:
            raise ValueError(f"'block_size' must be an int >= 2 (got {block_size!r})")
        self.tree_budget = _check_tree_budget(tree_budget, target, drafter)
        if block_size > target.max_draft:
            raise ValueError(
                f"'block_size'={block_size} exceeds the checkpoint slots "
                f"max_draft={target.max_draft} the target was built with"
            )
        self.target, self.drafter, self.block_size = target, drafter, block_size
        self.policy = policy or RollbackPolicy()
        self.faults = faults or NO_FAULTS
        self.verify_window = verify_window
        self._window_devices = [str(s.device) for s in target.shards]
        self.window: VerifyWindow = make_window(verify_window, self._window_devices)
        # trees grow from a proposal's per-slot candidates, drafted on the device with
        # graphs when the drafter can (read back with the step's tokens), else on the
        # host; a drafter's own trees (and a DFlash2 selector's) are drafted on the host
        self.drafts: DraftSource = (
            HostDrafts(target, drafter, block_size)
            if self.tree_budget is not None and isinstance(drafter, TreeDrafter)
            else draft_source(target, drafter, block_size,
                              TREE_CANDIDATES if self.tree_budget is not None else 0)
        )
        dtype = target.model.embed_tokens.weight.dtype
        self.gate = CaptureGate(requested=self.policy.fast, tolerance=self_test_tolerance(dtype))
        self._capture_for(self.policy.mode)
        self.rollback = Rollback(target, self.policy.mode, self.faults)
        self.sampling = sampling
        self.accept: AcceptanceRule = TokenAcceptance(sampling)
        if isinstance(drafter, CoupledDrafter):  # its guesses drawn with the target's noise
            drafter.couple(sampling)
        self.taps = tuple(drafter.tap_layers)
        self.committed = 0  # tokens in every shard's caches
        self.context: list[int] = []  # those tokens
        #: tokens of the last prompt a ``reuse`` prefill found in the caches (not re-read)
        self.reused = 0
        self.last = -1  # the pending token (chosen, not yet in the caches)
        #: the steps of the current generation (:func:`dflash.execution.generate` clears it
        #: when one starts, so a kept engine holds one generation's records, not every
        #: step it ever ran); :attr:`steps_run` counts them all
        self.records: list[StepRecord] = []
        self.steps_run = 0
        self._paths = {"fast": 0, "replay": 0, "replay_after_failure": 0}
        self.verifies = 0  # verify forwards run
        self.status_at_start = self.status
        self._pending: Verified | None = None
        self._forwards_before = 0  # target forwards before the current step

    # -- status ---------------------------------------------------------------------------

    @property
    def status(self) -> RollbackStatus:
        if self.rollback.poisoned:
            return RollbackStatus.POISONED
        if not self.policy.fast:
            return RollbackStatus.OFF
        if self.fast_unavailable_reason is not None:  # requested, never effective
            return RollbackStatus.REQUESTED
        return RollbackStatus.EFFECTIVE if self.gate.validated else RollbackStatus.REQUESTED

    @property
    def fast_unavailable_reason(self) -> str | None:
        """Why a fast mode cannot become effective: capture storage that could not be
        allocated (the steps roll back through replay); None when the storage is whole."""
        return self.target.fast_unavailable_reason

    @property
    def target_forwards(self) -> int:
        """Target forwards run by the steps: every verify and every replay."""
        return self.verifies + self.rollback.replays

    @property
    def counts(self) -> dict[str, int]:
        """Steps per rollback path, and the poison events (rollbacks that failed after
        state began to change)."""
        return {**self._paths, "poison_events": self.rollback.poison_events}

    @property
    def life(self) -> Lifecycle:
        """The steps' lifecycle (owned by :attr:`rollback`)."""
        return self.rollback.life

    @property
    def device_drafter(self) -> DeviceDrafter | None:
        """The drafter when it drafts on the device (see :mod:`dflash.execution.drafts`)."""
        drafts = self.drafts
        return drafts.device_drafter if isinstance(drafts, DeviceDrafts) else None

    # -- prefill --------------------------------------------------------------------------

    @torch.inference_mode()
    def prefill(
        self,
        prompt: Sequence[int],
        *,
        reuse: bool = False,
        cache: PrefixCache | None = None,
        on_chunk: Callable[[int, int], None] | None = None,
    ) -> int:
        """Run the prompt; return the first generated token (now pending).

        The prompt goes through the target in chunks of its ``prefill_chunk`` tokens
        (:meth:`ShardedTarget.prefill`; ``on_chunk(done, total)`` after each). Two ways
        not to prefill what was prefilled before, :attr:`reused` telling how many tokens
        were kept (0: a new sequence from position 0):

        - ``cache``: a :class:`PrefixCache` of this target. The longest cached chunk
          boundary that is a proper prefix of ``prompt`` is restored and only the rest is
          prefilled, and the prompt's own last boundary is cached: the logits are a cold
          prefill's, bit for bit (see :mod:`dflash.execution.prefix`).
        - ``reuse``: when this engine's caches hold a proper prefix of ``prompt`` — its
          committed tokens (:attr:`context`: the previous prompt and the output committed
          after it, the pending token excluded) — and its drafter can continue from there
          (:meth:`DraftSource.can_continue`), only the rest is prefilled, continuing that
          state: a conversation's next turn re-reads nothing (its output is plain
          decoding's along that path; a cold prefill of the same tokens rounds
          differently)."""
        vocab = self.target.model.config.vocab_size
        if len(prompt) == 0:
            raise ValueError("'prompt' must hold at least one token (got an empty prompt)")
        for i, tok in enumerate(prompt):
            if isinstance(tok, bool) or not isinstance(tok, int) or not 0 <= tok < vocab:
                raise ValueError(
                    f"'prompt' entry {i} must be a token id in [0, {vocab}) (got {tok!r})"
                )
        if cache is not None and (reuse or cache.chunk != self.target.prefill_chunk):
            raise ValueError(
                "a prefix 'cache' needs reuse=False and the target's prefill chunk "
                f"({self.target.prefill_chunk}; the cache's: {cache.chunk})"
            )
        hit = None if cache is None else cache.lookup(prompt)
        keep = hit.length if hit is not None else (self.reusable(prompt) if reuse else 0)
        # refused before anything changes (a restored prefix has the capacity of a cold one)
        self.target.check_prefill(len(prompt) - keep, 0 if hit is not None else keep)
        self.rollback.life.move("prefill")
        self.window = make_window(self.verify_window, self._window_devices)
        if hit is not None:
            self.target.restore(hit.snapshots)
        logits, features = prefill_through(
            self.target, prompt, keep=keep, hit=hit, cache=cache, taps=self.taps,
            reach=self.drafts.feature_rows(), on_chunk=on_chunk,
        )
        self.committed, self.context, self.reused = len(prompt), list(prompt), keep
        self.last = int(self.accept.tokens(logits[-1:], self._drawn_at("prefill", 1)))
        self.target.require_position(self.committed, what="after prefill")
        # the drafter starts afresh from the rows it reads (a cache restored them), or
        # continues its context at ``keep`` (reuse)
        at = 0 if cache is not None else keep
        rows = 0 if features is None else int(features.shape[0])
        self.drafts.start(features, self.last, at, len(prompt) - at - rows if rows else 0)
        return self.last

    def reusable(self, prompt: Sequence[int]) -> int:
        """How many leading tokens of ``prompt`` a ``reuse`` prefill keeps: this engine's
        committed tokens when they are a proper prefix of it, the last step was rolled back
        cleanly and the drafter can continue from them; else 0."""
        n = self.committed
        if not 0 < n < len(prompt) or list(prompt[:n]) != self.context:
            return 0
        if self.rollback.poisoned or self._pending is not None:
            return 0
        return n if self.drafts.can_continue(n) else 0

    def _drawn_at(self, kind: Literal["prefill", "chain", "tree"], n: int) -> Tensor | None:
        """The absolute positions of the tokens the last forward's ``n`` rows draw — the
        sampling rule's key — on the logits' device, from the device's committed position
        (no host value, no copy): the prefill's last row draws ``committed``; a chain's row
        ``i`` draws ``committed + i + 1``, a tree's node ``u`` ``committed + depth(u) + 1``
        (the tree tables the verify read). None when greedy (no key needed)."""
        if self.sampling.greedy:
            return None
        caches = self.target.shards[-1].caches
        start = caches.pool.position[:1]  # [1]: the verify does not move it
        if kind == "prefill":
            return start.clone()
        if kind == "tree":
            return start + 1 + caches.tree.depth[:n]
        return start + torch.arange(1, n + 1, device=start.device)

    # -- the step -------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> list[int]:
        """One speculative step; returns the emitted tokens (1 … B of them)."""
        self.rollback.begin_step()
        self._forwards_before = self.target_forwards
        gate = self.policy.fast and self.gate.pending and self.fast_unavailable_reason is None
        if self.tree_budget is not None:
            return self._tree_step(gate=gate)
        if gate:
            return self._gate_step()
        step = self.steps_run
        guesses, confidence = self.drafts.take(self.context, self.last)  # [B-1]
        T = self.window.size(self.committed, self.block_size, confidence)  # 1 … B
        draft = self._draft(guesses, T)  # d: [T], validated as a chain of T slots
        status_before = self.status
        fast = status_before is RollbackStatus.EFFECTIVE
        logits, taps, ids = self._verify(draft)  # logits: [T, vocab]; ids: [1, T] on device
        t_dev, count = self._accept_chain(logits, ids)  # [T], [1] on the device
        # the fast rollback is enqueued on the device's count before the one host read
        started = self.rollback.enqueue_fast(self.committed, T, count, step) if fast else None
        v = self._read_back(draft, t_dev, count, taps, status_before, undo=fast)  # one sync
        d = draft.tokens
        if started is not None:
            path, failure = self.rollback.finish_fast(
                d, self.committed, v.commit_n, step, started
            )
        else:
            self.rollback.replay(d, self.committed, v.commit_n)
            path, failure = "replay", None
        return self._commit(path, failure)

    def _gate_step(self) -> list[int]:
        """The capture gate's step: the whole block verified on poisoned (armed) storage,
        inspected between the shards and judged after; the rollback through replay, then,
        when the evidence held, the one-time self-test of a checkpoint slot against it."""
        step, B = self.steps_run, self.block_size
        guesses, _ = self.drafts.take(self.context, self.last)
        draft = self._draft(guesses, B)
        storages = self.target.storages()
        self.gate.arm(storages)
        status_before = self.status
        logits, taps, ids = self._verify(draft, lambda k: self.gate.after_shard(k, storages))
        t_dev, count = self._accept_chain(logits, ids)
        v = self._read_back(draft, t_dev, count, taps, status_before, undo=False)
        valid = self.gate.judge(storages, B, v.taps, self.taps)
        saved = self.gate.save_slot(storages, v.commit_n - 1) if valid else None
        self.rollback.replay(draft.tokens, self.committed, v.commit_n)
        if saved is not None:
            self.gate.self_test(self.target.storages(), v.commit_n - 1, saved, step)
        return self._commit("replay", None)

    def _tree_step(self, *, gate: bool = False) -> list[int]:
        """A tree step: the drafter's tree of at most ``tree_budget`` nodes, validated, then
        one verify; the accepted path is the deepest node whose path the target's greedy
        tokens confirm (read back once); the rollback restores (or remaps) that node's
        state, takes the conv window along its path and compacts its K/V rows, or, until
        the status is ``effective``, replays the path.

        ``gate``: the capture gate's step, on a tree — its verify on poisoned storage,
        judged (every node's slot written), the path replayed, then the one-time
        self-test of the accepted node's slot and the conv window along its path."""
        step = self.steps_run
        assert self.tree_budget is not None
        if isinstance(self.drafter, TreeDrafter):
            tree = self.drafter.draft_tree(
                list(self.context), self.last, self.tree_budget, self.block_size - 1
            )
        else:  # the chain proposal's per-slot distributions, grown best first
            proposal, _ = self.drafts.take(self.context, self.last)
            device = self.drafts if isinstance(self.drafts, DeviceDrafts) else None
            branch = (  # prompt lookup's copy, kept whole as one branch when there is one
                self.drafter.tree_branch() if isinstance(self.drafter, BranchDrafter) else None
            )
            if branch is None and not self.sampling.greedy:
                # sampling: the proposal's draws (coupled with the target's noise when the
                # drafter couples) are the path plain sampling is likeliest to take
                branch = proposal
            inner = (self.drafter.dflash if isinstance(self.drafter, LookupAssistedDrafter)
                     else self.drafter)
            if isinstance(inner, DFlash2Drafter):  # its selector's dependent paths
                tree = inner.selector_tree(self.last, self.tree_budget, branch=branch)
            else:
                candidates = (device.candidates() if device is not None else
                              cast(CandidateDrafter, self.drafter).candidates(TREE_CANDIDATES))
                tree = best_first_tree(self.last, candidates, self.tree_budget, branch=branch)
        draft = self._tree_draft(tree)
        storages = self.target.storages() if gate else []
        if gate:
            self.gate.arm(storages)
        status_before = self.status
        T = len(tree)
        logits, taps, ids = self._verify(
            draft, (lambda k: self.gate.after_shard(k, storages)) if gate else None
        )
        # on the device: the target's token after each node's path [T], and the deepest
        # confirmed node, its path's length and its padded path ([2 + T])
        t_dev, accepted = self._accept_tree(logits, ids)
        fast = status_before is RollbackStatus.EFFECTIVE
        # the fast rollback is enqueued on the device's path before the one host read
        started = (self.rollback.enqueue_fast(self.committed, T, accepted, step, tree=True)
                   if fast else None)
        # drafting on the device: the next proposal from the accepted path's rows, enqueued
        # first (the path's nodes, -1 past its end, are at most a block)
        on_path = accepted[2 : 2 + min(T, self.block_size)].clamp(min=0)
        drafted = self.drafts.enqueue_next(
            {k: v.index_select(1, on_path.to(v.device)) for k, v in taps.items()},
            accepted[1:2], t_dev.index_select(0, on_path.to(t_dev.device)),
        ) if isinstance(self.drafts, DeviceDrafts) else None
        parts = [t_dev, accepted[:2]] + ([] if drafted is None else [drafted.to(t_dev.device)])
        read = torch.cat(parts).tolist()  # the step's one synchronisation
        t = read[:T]  # t[s]: the target's token after node s's path
        _, path = accept_tree(tree, t)  # the host's reading: the deepest confirmed node
        if path[-1] != read[T] or len(path) != read[T + 1]:
            if started is not None:
                self.rollback.undo_enqueued()
            raise ExecutionError(
                f"device tree acceptance (node {read[T]}, {read[T + 1]} tokens) disagrees "
                f"with the host's path {path} for target tokens {t}"
            )
        d = [tree.tokens[s] for s in path]
        saved = None
        if gate and self.gate.judge(storages, T, taps, self.taps):
            saved = self.gate.save_slot(storages, path[-1], path)
        if taps:  # the drafter's features of the committed tokens: the path's rows
            taps = {k: v.index_select(1, accepted[2 : 2 + len(path)].to(v.device))
                    for k, v in taps.items()}
        self.drafts.committed(taps, len(path), read[T + 2 :])
        self._pending = Verified(
            d, [t[s] for s in path], len(path), taps, status_before, nodes=T
        )
        if started is not None:
            how, failure = self.rollback.finish_fast(
                d, self.committed, len(path), step, started, path
            )
        else:
            self.rollback.replay(d, self.committed, len(path))
            how, failure = "replay", None
            if saved is not None:
                self.gate.self_test(self.target.storages(), path[-1], saved, step)
        return self._commit(how, failure)

    def _tree_draft(self, tree: DraftTree) -> Draft:
        """The drafter's tree checked (root = the pending token, token ids, size, depth,
        KV capacity) and validated by :func:`require_tree` before any kernel runs."""
        label = self.drafter.label
        if not isinstance(tree, DraftTree):
            raise ExecutionError(f"drafter {label!r} returned {type(tree).__name__}, not a tree")
        vocab = self.target.model.config.vocab_size
        bad = [s for s, tok in enumerate(tree.tokens) if not 0 <= tok < vocab]
        if tree.tokens[0] != self.last or bad:
            raise ExecutionError(
                f"drafter {label!r} returned a tree rooted at {tree.tokens[0]} (pending "
                f"{self.last}) or with token ids outside [0, {vocab}) at slots {bad}"
            )
        assert self.tree_budget is not None
        if len(tree) > self.tree_budget:
            raise ExecutionError(
                f"drafter {label!r} returned {len(tree)} nodes, over tree_budget="
                f"{self.tree_budget}"
            )
        try:
            geometry = require_tree(tree.parents)
        except Exception as exc:
            raise ExecutionError(f"drafter {label!r} returned a malformed tree: {exc}") from None
        if max(geometry.depth) > self.block_size - 1:
            raise ExecutionError(
                f"drafter {label!r} returned a tree {max(geometry.depth)} deep, over "
                f"block_size - 1 = {self.block_size - 1}"
            )
        if self.committed + len(tree) > self.target.max_len:
            raise ExecutionError(
                f"KV cache capacity exhausted: a verify of {len(tree)} nodes at position "
                f"{self.committed} needs {self.committed + len(tree)} positions, the caches "
                f"hold max_len={self.target.max_len}"
            )
        self.target.require_position(self.committed, what="before verify")
        return Draft(list(tree.tokens), geometry)

    def _draft(self, guesses: list[int], window: int) -> Draft:
        """``[last, *guesses[:window-1]]``, checked to fit the caches and validated as a
        chain (:func:`chain_of`) before any kernel runs."""
        if self.committed + self.block_size > self.target.max_len:
            raise ExecutionError(
                f"KV cache capacity exhausted: a verify of {self.block_size} tokens at "
                f"position {self.committed} needs {self.committed + self.block_size} "
                f"positions, the caches hold max_len={self.target.max_len}"
            )
        d = [self.last, *guesses[: window - 1]]
        draft = Draft(d, chain_of(len(d)))
        self.target.require_position(self.committed, what="before verify")
        return draft

    def _verify(
        self, draft: Draft, after_shard: Callable[[int], None] | None = None
    ) -> tuple[Tensor, dict[int, Tensor], Tensor]:
        """One target forward over the draft at ``committed …``: (logits ``[T, vocab]``,
        the drafter's tap rows, the ``[1, T]`` ids on the first shard's device, also used
        by the acceptance)."""
        self.rollback.life.move("verify")
        ids = device_ids(draft.tokens, self.target.shards[0].device)  # [1, T]
        logits, taps = self.target.forward(
            ids, "verify", self.committed, geometry=draft.geometry, taps=self.taps,
            after_shard=after_shard,
        )
        self.verifies += 1
        return logits, taps, ids

    def _accept_chain(self, logits: Tensor, ids: Tensor) -> tuple[Tensor, Tensor]:
        """The acceptance of a chain verify on the device: the target's token at every row
        (``[T]``, drawn at the rows' positions) and the accepted count (``[1]``) against
        the drafted ``ids: [1, T]`` — replayed from a CUDA graph when graphs are on
        (:meth:`ShardedTarget.on_logits`), so a sampled rule's launches cost no host time."""
        T = int(logits.shape[0])

        def work(d: Tensor) -> tuple[Tensor, Tensor]:
            return self.accept.on_device(logits, d, self._drawn_at("chain", T))

        return self.target.on_logits("chain", logits, ids[0].to(logits.device), self.accept,
                                     work)

    def _accept_tree(self, logits: Tensor, ids: Tensor) -> tuple[Tensor, Tensor]:
        """The acceptance of a tree verify on the device: the target's token after each
        node's path (``[T]``) and ``[2 + T]`` int64 = (the deepest confirmed node, its
        path's length, its ``-1``-padded path), from the tree tables the verify read —
        replayed from a CUDA graph when graphs are on, as :meth:`_accept_chain`."""
        T = int(logits.shape[0])
        tables = self.target.shards[-1].caches.tree

        def work(d: Tensor) -> tuple[Tensor, Tensor]:
            t = self.accept.tokens(logits, self._drawn_at("tree", T))
            best, count, path = accept_tree_device(d, t, tables.depth, tables.paths, T)
            return t, torch.cat([best, count, path])

        return self.target.on_logits("tree", logits, ids[0].to(logits.device), self.accept,
                                     work)

    def _read_back(
        self, draft: Draft, t_dev: Tensor, count: Tensor, taps: dict[int, Tensor],
        status_before: RollbackStatus, *, undo: bool,
    ) -> Verified:
        """The step's one host synchronisation: the target's tokens, the accepted count and
        (drafting on the device) the next step's guesses, enqueued first. A count that
        disagrees with the tokens is an error (``undo``: the enqueued rollback is put back
        first)."""
        d = draft.tokens
        T = len(d)
        drafted = self.drafts.enqueue_next(taps, count, t_dev)  # [B-1] on the device, or None
        parts = [t_dev, count] if drafted is None else [t_dev, count, drafted.to(count.device)]
        read = torch.cat(parts).tolist()
        t, accept_n = read[:T], read[T]  # t[i]: the target's token after d[0..i]
        if accept_n != self.accept.on_host(d, t):
            if undo:
                self.rollback.undo_enqueued()
            raise ExecutionError(f"device acceptance count {accept_n} disagrees with {t}")
        self.window.record(self.committed, T, accept_n)
        self.drafts.committed(taps, accept_n, read[T + 1 :])
        self._pending = Verified(d, t, accept_n, taps, status_before)
        return self._pending

    def _commit(self, path: RollbackPath, failure: str | None) -> list[int]:
        v = self._pending
        assert v is not None
        self.target.require_position(self.committed + v.commit_n, what="after rollback")
        self.rollback.life.move("commit")
        self.context.extend(v.d[: v.commit_n])
        self.committed += v.commit_n
        self.last = v.emitted[-1]
        step = self.steps_run
        forwards = self.target_forwards - self._forwards_before
        self.records.append(
            StepRecord(
                step, tuple(v.d), v.commit_n, tuple(v.emitted), path, v.status_before,
                forwards, failure, v.nodes or len(v.d),
            )
        )
        self.steps_run += 1
        self._paths[path] += 1
        self._pending = None
        return v.emitted

    # -- after a failed recovery ----------------------------------------------------------

    def recover_pending(self, failure: str = "") -> None:
        """Restore the pre-verify state on every shard and replay the pending step's tokens
        (``POISONED`` or a failed ``VERIFIED`` → ``ROLLED_BACK``); if this raises, the
        target stays poisoned and verify keeps refusing."""
        v = self._pending
        if v is None:
            raise ExecutionError("nothing to recover: no step is pending")
        self.rollback.recover(v.d, self.committed, v.commit_n, self.steps_run, failure)

    def resume(self) -> list[int]:
        """Complete a step whose recovery failed earlier (the target is poisoned)."""
        if not self.rollback.poisoned:
            raise ExecutionError("resume() is only for a poisoned target")
        self.recover_pending("an earlier failed recovery")
        return self._commit("replay_after_failure", "recovered by resume()")

    # -- requests between steps ----------------------------------------------------------

    def use_sampling(self, sampling: SamplingParams) -> None:
        """Draw the target's tokens by ``sampling``'s rule from the next generation on
        (between steps only; a kept engine serves requests with different rules)."""
        if not isinstance(sampling, SamplingParams):
            raise ValueError(
                f"'sampling' must be a SamplingParams (got {type(sampling).__name__})"
            )
        self.rollback.require_clean("use_sampling")
        self.sampling = sampling
        self.accept = TokenAcceptance(sampling)
        if isinstance(self.drafter, CoupledDrafter):
            self.drafter.couple(sampling)

    def request_mode(self, mode: str) -> None:
        """Ask for another rollback mode from the next step on (between steps only).

        A fast mode becomes effective only through the capture gate; a verdict already
        reached stays (sticky for the engine's lifetime, until storage is rebuilt).
        """
        self.rollback.require_clean("request_mode")
        new = RollbackPolicy(mode=parse_mode(mode, source="'mode'"))
        if self._capture_for(new.mode):
            self.rollback.life.move("rebuild")
            self.gate.reset()
        self.policy = new
        self.rollback.mode = new.mode
        if new.fast and not self.gate.requested:
            self.gate.request()

    def _capture_for(self, mode: str) -> bool:
        """Give the target the capture storage a fast ``mode`` needs (``recompute``: the
        recurrence's inputs; the others: states), rebuilding it when it holds the other
        kind, or inputs without the node-state scratch this engine's tree verifies need;
        True when it was rebuilt. ``replay`` runs on either kind."""
        kind = self.target.capture if mode == "replay" else capture_kind(mode)
        trees = self.tree_budget is not None and kind == "inputs" and not self.target.trees
        if self.target.capture == kind and not trees:
            return False
        self.target.rebuild_storage(kind, trees=True if trees else None)
        return True

    def rebuild_storage(self) -> None:
        """Rebuild every shard's capture storage; the capture gate forgets its verdict."""
        self.rollback.require_clean("rebuild_storage")
        self.rollback.life.move("rebuild")
        self.target.rebuild_storage()
        self.gate.reset()


#: candidates per depth a tree grows from (a drafter's per-slot distributions)
TREE_CANDIDATES = 8


def _check_tree_budget(budget: object, target: ShardedTarget, drafter: Drafter) -> int | None:
    """``tree_budget`` checked against the target and drafter (None: chains)."""
    if budget is None:
        return None
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 2:
        raise ValueError(f"'tree_budget' must be None or an int >= 2 (got {budget!r})")
    if budget > target.max_draft:
        raise ValueError(
            f"'tree_budget'={budget} exceeds the capture slots max_draft={target.max_draft} "
            "the target was built with"
        )
    tree_drafter = isinstance(drafter, TreeDrafter) and not drafter.tap_layers
    if not tree_drafter and not isinstance(drafter, CandidateDrafter):
        raise ValueError(
            f"'tree_budget' needs a drafter that proposes trees, or per-slot candidates, on "
            f"the host (got {getattr(drafter, 'label', type(drafter).__name__)!r})"
        )
    return budget
