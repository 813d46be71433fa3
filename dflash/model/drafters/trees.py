"""Draft trees: the best-first construction, the host reference of tree acceptance, and a
SYNTHETIC tree drafter for shape benchmarks.

A :class:`DraftTree` holds ``N`` slots: slot 0 is the root (the pending token ``last``) and
every other slot names an earlier slot as its parent — the layout
:func:`dflash.geometry.validate_tree` accepts. One verify forward gives ``target[s]``, the
target's greedy token after the path root..s; :func:`accept_tree` keeps the deepest slot whose
every token on its path equals the target's token after its parent.

:func:`best_first_tree` builds the tree from a drafter's per-depth top-k candidates (the DFlash
drafter's per-position distributions: each depth's candidates do not depend on the tokens
chosen at earlier depths). A path's score is the sum of its tokens' log-probabilities, and the
tree holds the best-scoring paths: a heap over the frontier, popped best first.
"""

from __future__ import annotations

import heapq
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from numbers import Real
from typing import Protocol, cast, runtime_checkable

from dflash.geometry import MAX_SLOTS, Rejection, TreeGeometry, require_tree, validate_tree
from dflash.model.drafters.base import check_context, check_token
from dflash.model.drafters.errors import DraftArgumentError, OracleMismatchError

#: One depth's candidates: ``(token, log_prob)`` pairs, best first.
Candidates = Sequence[Sequence[tuple[int, float]]]


@dataclass(frozen=True)
class DraftTree:
    """A draft tree, validated on construction (bad fields raise :class:`DraftArgumentError`).

    ``tokens[s]``: slot ``s``'s token (``tokens[0]`` the root, the pending token);
    ``parents[s]``: its parent slot (``parents[0] == -1``, ``parents[s] < s``);
    ``log_probs[s]``: the joint log-probability of the path root..s under the drafter
    (the root's is 0.0; ``-inf`` for a path through a token the drafter did not score, e.g. a
    prompt-lookup branch token outside that depth's candidates).
    """

    tokens: tuple[int, ...]
    parents: tuple[int, ...]
    log_probs: tuple[float, ...]

    def __post_init__(self) -> None:
        for name in ("tokens", "parents", "log_probs"):
            value = getattr(self, name)
            if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
                raise DraftArgumentError(
                    f"{name!r} must be a sequence (got {type(value).__name__})"
                )
            object.__setattr__(self, name, tuple(value))
        n = len(self.tokens)
        if n < 1 or len(self.parents) != n or len(self.log_probs) != n:
            raise DraftArgumentError(
                f"'tokens', 'parents' and 'log_probs' must have the same length >= 1 "
                f"(got {n}, {len(self.parents)}, {len(self.log_probs)})"
            )
        verdict = validate_tree(self.parents)
        if isinstance(verdict, Rejection):
            raise DraftArgumentError(f"not a draft tree: {verdict.message}")
        # the common case checked in one pass (exact ints >= 0, exact floats <= 0: NaN
        # fails the comparison); anything else is checked entry by entry, and named
        if not all(type(t) is int and t >= 0 for t in self.tokens):
            for s, token in enumerate(self.tokens):
                check_token(f"tokens[{s}]", token)
        if not all(type(lp) is float and lp <= 0 for lp in self.log_probs):
            for s, lp in enumerate(self.log_probs):
                value = (float(lp) if isinstance(lp, Real) and not isinstance(lp, bool)
                         else math.nan)
                if math.isnan(value) or value > 0:
                    raise DraftArgumentError(
                        f"'log_probs[{s}]' must be a log-probability <= 0 or -inf (got {lp!r})"
                    )
            object.__setattr__(self, "log_probs", tuple(float(lp) for lp in self.log_probs))
        if self.log_probs[0] != 0.0:
            raise DraftArgumentError(f"'log_probs[0]' is the root's and must be 0.0 "
                                     f"(got {self.log_probs[0]!r})")

    def __len__(self) -> int:
        return len(self.tokens)

    def geometry(self) -> TreeGeometry:
        """The validated geometry of ``parents`` (depth, children, ancestor mask)."""
        return require_tree(self.parents)


def chain_tree(
    root: int, guesses: Sequence[int], *, log_probs: Sequence[float] | None = None
) -> DraftTree:
    """The chain ``[root, guesses...]`` as a :class:`DraftTree` (``parents[s] = s - 1``).

    ``log_probs[i]``: the drafter's log-probability of ``guesses[i]`` (summed into each
    slot's joint log-probability); ``None``: an unscored chain, every slot's is 0.0.
    """
    check_token("root", root)
    if isinstance(guesses, (str, bytes)) or not isinstance(guesses, Sequence):
        raise DraftArgumentError(
            f"'guesses' must be a sequence of token ids (got {type(guesses).__name__})"
        )
    if len(guesses) + 1 > MAX_SLOTS:
        raise DraftArgumentError(
            f"a chain of {len(guesses)} guesses exceeds MAX_SLOTS={MAX_SLOTS} slots"
        )
    tokens = (root, *(check_token(f"guesses[{i}]", g) for i, g in enumerate(guesses)))
    joint = [0.0]
    if log_probs is not None:
        if isinstance(log_probs, (str, bytes)) or not isinstance(log_probs, Sequence) or len(
            log_probs
        ) != len(guesses):
            raise DraftArgumentError(
                f"'log_probs' must be a sequence of {len(guesses)} log-probabilities, one per "
                f"guess (got {log_probs!r})"
            )
        for i, lp in enumerate(log_probs):
            joint.append(joint[-1] + _check_log_prob(f"log_probs[{i}]", lp))
    else:
        joint += [0.0] * len(guesses)
    return DraftTree(tokens, (-1, *range(len(guesses))), tuple(joint))


def tree_path(tree: DraftTree, u: int) -> list[int]:
    """The slots of the path from the root to ``u``: ``[0, ..., u]``."""
    if isinstance(u, bool) or not isinstance(u, int) or not 0 <= u < len(tree.tokens):
        raise DraftArgumentError(f"'u' must be a slot in [0, {len(tree.tokens)}) (got {u!r})")
    path = [u]
    while path[-1] != 0:
        path.append(tree.parents[path[-1]])
    return path[::-1]


def tree_paths_tokens(tree: DraftTree, u: int) -> list[int]:
    """The tokens of the path root..u, root first (``tree.tokens[0]`` ... ``tree.tokens[u]``)."""
    return [tree.tokens[s] for s in tree_path(tree, u)]


def best_first_tree(
    root: int, candidates: Candidates, budget: int, *, branch: Sequence[int] | None = None
) -> DraftTree:
    """The draft tree of the ``budget`` best paths (root included) by joint log-probability.

    Args:
        root: the pending token (slot 0).
        candidates: ``candidates[d]`` is the drafter's top-k at depth ``d + 1``: distinct
            ``(token, log_prob)`` pairs, log-probs finite and <= 0, best first
            (non-increasing). Each depth's candidates do not depend on earlier depths' tokens.
        budget: the most slots the tree holds, root included, in ``[1, MAX_SLOTS]``.
        branch: an extra chain of tokens after the root (prompt lookup's copy), or None.

    Returns:
        The tree. Slot order: the root, then the branch's slots (depths 1, 2, ...), then the
        best-first nodes in the order they were popped — best score first; a parent always
        precedes its children.

    The prefix of ranks ``r = (i_1, ..., i_d)`` is the path of tokens
    ``candidates[0][i_1], ..., candidates[d-1][i_d]``; its score is
    ``S(r) = lp_1[i_1] + ... + lp_d[i_d]`` and it is ordered by the key
    ``(-S(r), d, r)`` (lower key = better; depth, then ranks break ties). The heap starts
    with ``(0,)``; popping ``r`` pushes its best child ``r + (0,)`` and its next sibling
    ``(..., i_d + 1)``, so every prefix is pushed exactly once (by its previous sibling, or
    by its parent when ``i_d = 0``) and the heap grows by at most one entry per pop. Both
    pushes have a larger key than ``r`` (log-probs are <= 0 and non-increasing by rank, and a
    tie in score is broken by depth or rank), so the pops come in increasing key order: the
    first ``n`` pops are the ``n`` best prefixes. They form a tree: a prefix's parent has a
    strictly smaller key, so it is among them too.

    ``branch``: its first ``budget // 2`` tokens (all of it when shorter) are inserted
    first as a chain from the root; then prefixes are popped as above, each either reusing
    the branch slot with the same parent and token (costing no slot) or taking a new one,
    until the tree holds ``budget`` slots or every prefix is in. The tree is thus the branch
    chain united with the longest run of best prefixes that fits the budget, and never holds
    two siblings with the same token. A branch slot's log-prob is its path's score under
    ``candidates`` (``-inf`` once the path holds a token outside that depth's candidates).
    """
    check_token("root", root)
    if isinstance(budget, bool) or not isinstance(budget, int) or not 1 <= budget <= MAX_SLOTS:
        raise DraftArgumentError(
            f"'budget' must be an int in [1, MAX_SLOTS={MAX_SLOTS}] (got {budget!r})"
        )
    levels = _check_candidates(candidates, budget)
    chain = _check_branch(branch)[: budget // 2]

    tokens = [root]
    parents = [-1]
    log_probs = [0.0]
    slot_of: dict[tuple[int, int], int] = {}  # (parent slot, token) -> slot
    by_token = [dict(level) for level in levels]  # depth d-1: token -> log-prob
    for d, token in enumerate(chain, start=1):
        lp = by_token[d - 1].get(token, -math.inf) if d <= len(levels) else -math.inf
        slot_of[(len(tokens) - 1, token)] = len(tokens)
        parents.append(len(tokens) - 1)
        tokens.append(token)
        log_probs.append(log_probs[-1] + lp)

    # heap entry: (-score, depth, ranks, parent slot, parent score); ranks are unique, so
    # the comparison never reaches the last two fields
    heap: list[tuple[float, int, tuple[int, ...], int, float]] = []
    if levels and len(tokens) < budget:
        heap.append((-levels[0][0][1], 1, (0,), 0, 0.0))
    while heap and len(tokens) < budget:
        neg_score, depth, ranks, parent, parent_score = heapq.heappop(heap)
        token = levels[depth - 1][ranks[-1]][0]
        slot = slot_of.get((parent, token))
        if slot is None:  # a new slot (else: the branch already holds this path)
            slot = len(tokens)
            slot_of[(parent, token)] = slot
            tokens.append(token)
            parents.append(parent)
            log_probs.append(-neg_score)
        if depth < len(levels):  # the best child: rank 0 at the next depth
            score = -neg_score + levels[depth][0][1]
            heapq.heappush(heap, (-score, depth + 1, (*ranks, 0), slot, -neg_score))
        rank = ranks[-1] + 1
        if rank < len(levels[depth - 1]):  # the next sibling: same parent, next rank
            score = parent_score + levels[depth - 1][rank][1]
            heapq.heappush(heap, (-score, depth, (*ranks[:-1], rank), parent, parent_score))
    return DraftTree(tuple(tokens), tuple(parents), tuple(log_probs))


def accept_tree(tree: DraftTree, target_tokens: Sequence[int]) -> tuple[int, list[int]]:
    """Host reference of tree acceptance: ``(deepest accepted slot, its path [0, ..., u])``.

    ``target_tokens[s]`` is the target's greedy token after the path root..s (one per slot).
    Slot ``u != 0`` matches when ``tokens[u] == target_tokens[parents[u]]``; it is accepted
    when it and every ancestor match (the root always is). Of the deepest accepted slots the
    lowest wins (two exist only when siblings share a token). For a chain this is
    ``leading_accepted(tokens, target_tokens) - 1``. The emitted tokens are the path's tokens
    after the root followed by ``target_tokens[u]``.
    """
    if not isinstance(tree, DraftTree):
        raise DraftArgumentError(f"'tree' must be a DraftTree (got {type(tree).__name__})")
    n = len(tree.tokens)
    if isinstance(target_tokens, (str, bytes)) or not isinstance(target_tokens, Sequence):
        raise DraftArgumentError(
            f"'target_tokens' must be a sequence of token ids "
            f"(got {type(target_tokens).__name__})"
        )
    if len(target_tokens) != n:
        raise DraftArgumentError(
            f"'target_tokens' must hold one token per slot, {n} (got {len(target_tokens)})"
        )
    target = [check_token(f"target_tokens[{s}]", t) for s, t in enumerate(target_tokens)]
    accepted = [True] + [False] * (n - 1)
    depth = [0] * n
    best = 0
    for s in range(1, n):  # parents[s] < s: a parent is decided before its children
        p = tree.parents[s]
        depth[s] = depth[p] + 1
        if accepted[p] and tree.tokens[s] == target[p]:
            accepted[s] = True
            if depth[s] > depth[best]:  # strictly deeper: ties keep the lower slot
                best = s
    return best, tree_path(tree, best)


class SyntheticTreeDrafter:
    """SYNTHETIC per-depth candidates for tree shape benchmarks: not a model.

    It knows the target's greedy sequence (``oracle``: prompt + greedy continuation, indexed
    by position, as for :class:`~dflash.model.drafters.synthetic.SyntheticDrafter`) and, at
    every depth, places the oracle's token at rank ``r`` of its ``k`` candidates with
    probability ``rank_probs[r]`` (``r < k``); with the remaining probability
    ``1 - sum(rank_probs[:k])`` the oracle's token is absent. The other candidates are
    distinct uniformly random tokens that differ from the oracle's. Depths are independent.
    Past the oracle's end every candidate is random.

    The candidate at rank ``r`` carries the log-probability ``log(rank_probs[r])``, the same
    at every depth: the drafter is calibrated, so a path's ``exp(joint log-prob)`` is the
    probability that every token on it is the oracle's, the expected number of accepted
    draft tokens of a tree is the sum of ``exp(log_probs)`` over its non-root slots, and
    :func:`best_first_tree` maximises it for a budget. ``rank_probs`` must therefore be
    positive and non-increasing (best first).

    Randomness is a pure function of ``(seed, len(context), depth)``: the same call gives
    the same candidates whatever was called before. Results that use it must say they are
    synthetic (``label``).
    """

    label = "synthetic-tree"
    tap_layers: tuple[int, ...] = ()

    def __init__(
        self, oracle: Sequence[int], rank_probs: Sequence[float], vocab_size: int, seed: int = 0
    ) -> None:
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 2:
            raise DraftArgumentError(f"'vocab_size' must be an int >= 2 (got {vocab_size!r})")
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise DraftArgumentError(f"'seed' must be an int >= 0 (got {seed!r})")
        if isinstance(oracle, (str, bytes)) or not isinstance(oracle, Sequence):
            raise DraftArgumentError(
                f"'oracle' must be a sequence of token ids (got {type(oracle).__name__})"
            )
        if isinstance(rank_probs, (str, bytes)) or not isinstance(rank_probs, Sequence) or not (
            rank_probs
        ):
            raise DraftArgumentError(
                f"'rank_probs' must be a non-empty sequence of probabilities (got {rank_probs!r})"
            )
        probs: list[float] = []
        for r, p in enumerate(rank_probs):
            if isinstance(p, bool) or not isinstance(p, Real) or not 0.0 < float(p) <= 1.0:
                raise DraftArgumentError(
                    f"'rank_probs[{r}]' must be a probability in (0, 1] (got {p!r})"
                )
            if probs and float(p) > probs[-1]:
                raise DraftArgumentError(
                    f"'rank_probs' must be non-increasing (best first): rank_probs[{r}]={p!r} "
                    f"exceeds rank_probs[{r - 1}]={probs[-1]!r}"
                )
            probs.append(float(p))
        if math.fsum(probs) > 1.0 + 1e-9:
            raise DraftArgumentError(f"'rank_probs' must sum to at most 1 (got {math.fsum(probs)})")
        self.oracle = tuple(
            check_token(f"oracle[{i}]", t, vocab_size) for i, t in enumerate(oracle)
        )
        self.rank_probs = tuple(probs)
        self.vocab_size = vocab_size
        self.seed = seed
        self._log_probs = tuple(math.log(p) for p in probs)

    def candidates(
        self, context: list[int], last: int, depth_count: int, k: int
    ) -> list[list[tuple[int, float]]]:
        """``depth_count`` lists of ``k`` distinct ``(token, log_prob)`` pairs, best first.

        ``k`` is at most ``len(rank_probs)`` and at most ``vocab_size - 1``.
        """
        position = len(check_context(context, check_tokens=False))  # reads only the length
        check_token("last", last, self.vocab_size)
        if isinstance(depth_count, bool) or not isinstance(depth_count, int) or depth_count < 1:
            raise DraftArgumentError(f"'depth_count' must be an int >= 1 (got {depth_count!r})")
        k_max = min(len(self.rank_probs), self.vocab_size - 1)
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= k_max:
            raise DraftArgumentError(
                f"'k' must be an int in [1, {k_max}] (min of len(rank_probs)="
                f"{len(self.rank_probs)} and vocab_size-1={self.vocab_size - 1}) (got {k!r})"
            )
        if position < len(self.oracle) and self.oracle[position] != last:
            raise OracleMismatchError(
                f"'last' at position {position} is {last}, the oracle has "
                f"{self.oracle[position]}: the sequence being drafted is not the oracle's"
            )
        return [self._depth(position, d, k) for d in range(1, depth_count + 1)]

    def _depth(self, position: int, d: int, k: int) -> list[tuple[int, float]]:
        rng = random.Random(f"dflash-synthetic-tree:{self.seed}:{position}:{d}")
        draw = rng.random()
        rank: int | None = None  # the oracle token's rank; None: absent
        total = 0.0
        for r, p in enumerate(self.rank_probs):
            total += p
            if draw < total:
                rank = r
                break
        q = position + d
        correct = self.oracle[q] if q < len(self.oracle) else None
        if correct is None:
            others = rng.sample(range(self.vocab_size), k)
        else:  # distinct tokens other than the oracle's: skip it in the numbering
            others = [t + (t >= correct) for t in rng.sample(range(self.vocab_size - 1), k)]
            if rank is not None and rank < k:
                others[rank] = correct
        return [(t, self._log_probs[r]) for r, t in enumerate(others)]

    def tree(
        self,
        context: list[int],
        last: int,
        budget: int,
        depth_count: int,
        k: int,
        *,
        branch: Sequence[int] | None = None,
    ) -> DraftTree:
        """:func:`best_first_tree` over :meth:`candidates` (SYNTHETIC)."""
        return best_first_tree(
            last, self.candidates(context, last, depth_count, k), budget, branch=branch
        )

    @property
    def max_candidates(self) -> int:
        """Candidates per depth a tree draws on: every rank of ``rank_probs`` (at most
        ``vocab_size - 1``)."""
        return min(len(self.rank_probs), self.vocab_size - 1)

    def draft_tree(
        self, context: list[int], last: int, budget: int, depth_count: int
    ) -> DraftTree:
        """The :class:`TreeDrafter` call: :meth:`tree` over :attr:`max_candidates` ranks."""
        return self.tree(context, last, budget, depth_count, self.max_candidates)

    def propose(
        self, context: list[int], last: int, block_size: int, features: object = None
    ) -> list[int]:
        """The chain a :class:`~dflash.model.drafters.base.Drafter` proposes: the rank-0
        candidate at each of the ``block_size - 1`` depths (the tree's best path)."""
        levels = self.candidates(context, last, block_size - 1, 1)
        return [level[0][0] for level in levels]


@runtime_checkable
class CandidateDrafter(Protocol):
    """A chain drafter whose last proposal also gives each guess slot's ``k`` best tokens
    with their log-probabilities, best first (``candidates(k)``): a tree grows from them
    (:func:`best_first_tree`)."""

    def candidates(self, k: int) -> list[list[tuple[int, float]]]: ...


@runtime_checkable
class BranchDrafter(Protocol):
    """A :class:`CandidateDrafter` that can also offer one whole branch for the tree (prompt
    lookup's copy from the context): ``tree_branch()`` after a proposal, None for none."""

    def tree_branch(self) -> list[int] | None: ...


@runtime_checkable
class TreeDrafter(Protocol):
    """A drafter that proposes trees: ``draft_tree(context, last, budget, depth_count)`` →
    a :class:`DraftTree` of at most ``budget`` slots (root = ``last``) at most
    ``depth_count`` deep. It is also a chain drafter (``propose``), which the capture gate's
    step and the fallbacks use."""

    label: str
    tap_layers: tuple[int, ...]

    def draft_tree(
        self, context: list[int], last: int, budget: int, depth_count: int
    ) -> DraftTree: ...

    def propose(
        self, context: list[int], last: int, block_size: int, features: object = None
    ) -> list[int]: ...


def _check_log_prob(name: str, lp: object) -> float:
    value = float(lp) if isinstance(lp, Real) and not isinstance(lp, bool) else math.nan
    if not math.isfinite(value) or value > 0:
        raise DraftArgumentError(f"{name!r} must be a finite log-probability <= 0 (got {lp!r})")
    return value


def _check_candidates(candidates: object, budget: int) -> list[list[tuple[int, float]]]:
    """Every depth: distinct tokens, finite log-probs <= 0, best first."""
    if isinstance(candidates, (str, bytes)) or not isinstance(candidates, Sequence):
        raise DraftArgumentError(
            f"'candidates' must be a sequence of per-depth candidate lists "
            f"(got {type(candidates).__name__})"
        )
    if not candidates and budget > 1:
        raise DraftArgumentError(
            f"'candidates' is empty: a budget of {budget} needs at least one depth"
        )
    levels: list[list[tuple[int, float]]] = []
    for d, level in enumerate(candidates):
        fast = _plain_level(level)
        if fast is not None:
            levels.append(fast)
            continue
        if isinstance(level, (str, bytes)) or not isinstance(level, Sequence) or not level:
            raise DraftArgumentError(
                f"'candidates[{d}]' must be a non-empty sequence of (token, log_prob) pairs "
                f"(got {level!r})"
            )
        pairs: list[tuple[int, float]] = []
        seen: set[int] = set()
        for i, pair in enumerate(level):
            name = f"candidates[{d}][{i}]"
            if not isinstance(pair, (tuple, list)) or len(pair) != 2:
                raise DraftArgumentError(f"{name!r} must be a (token, log_prob) pair "
                                         f"(got {pair!r})")
            token = check_token(f"{name} token", pair[0])
            lp = _check_log_prob(f"{name} log_prob", pair[1])
            if token in seen:
                raise DraftArgumentError(f"{name!r}: token {token} appears twice at depth {d + 1}")
            if pairs and lp > pairs[-1][1]:
                raise DraftArgumentError(
                    f"'candidates[{d}]' must be best first: entry {i} has log-prob {lp!r}, "
                    f"above entry {i - 1}'s {pairs[-1][1]!r}"
                )
            seen.add(token)
            pairs.append((token, lp))
        levels.append(pairs)
    return levels


def _plain_level(level: object) -> list[tuple[int, float]] | None:
    """The common case of one depth's candidates checked in one pass: a non-empty list or
    tuple of 2-tuples of an exact int >= 0 and an exact finite float <= 0, distinct
    tokens, best first; None for anything else (then checked entry by entry, and the
    first bad entry named)."""
    if type(level) not in (list, tuple) or not level:
        return None
    pairs = cast(list[tuple[int, float]], list(cast(Sequence[object], level)))
    previous = 0.0
    for pair in pairs:
        if type(pair) is not tuple or len(pair) != 2:
            return None
        token, lp = pair
        if (type(token) is not int or token < 0 or type(lp) is not float
                or not -math.inf < lp <= previous):
            return None
        previous = lp
    if len({pair[0] for pair in pairs}) != len(pairs):
        return None
    return pairs


def _check_branch(branch: object) -> list[int]:
    if branch is None:
        return []
    if isinstance(branch, (str, bytes)) or not isinstance(branch, Sequence):
        raise DraftArgumentError(
            f"'branch' must be None or a sequence of token ids (got {type(branch).__name__})"
        )
    return [check_token(f"branch[{i}]", t) for i, t in enumerate(branch)]
