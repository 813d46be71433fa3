"""Draft trees: best_first_tree against brute force, accept_tree against a naive recursion and
the chain rule, and the SYNTHETIC tree drafter's rank distribution and calibration."""

from __future__ import annotations

import itertools
import math
import random
import re
from collections.abc import Sequence

import pytest

from dflash.execution.engine import leading_accepted
from dflash.geometry import MAX_SLOTS, require_tree
from dflash.model.drafters.errors import DraftArgumentError, OracleMismatchError
from dflash.model.drafters.trees import (
    DraftTree,
    SyntheticTreeDrafter,
    accept_tree,
    best_first_tree,
    chain_tree,
    tree_path,
    tree_paths_tokens,
)

Level = list[tuple[int, float]]
DELTA = 1e-6  # per-check failure probability of a correct implementation (Hoeffding)


def hoeffding_radius(n: int, spread: float = 1.0, delta: float = DELTA) -> float:
    """P(|mean of n samples in a range of width spread - expectation| >= r) <= delta."""
    return spread * math.sqrt(math.log(2 / delta) / (2 * n))


def random_candidates(rng: random.Random, depths: int, vocab: int = 6) -> list[Level]:
    """Per-depth candidate lists; quantised log-probs (0.0 included) make ties common."""
    levels: list[Level] = []
    for _ in range(depths):
        k = rng.randint(1, 3)
        tokens = rng.sample(range(vocab), k)
        if rng.random() < 0.5:
            lps = sorted((-0.5 * rng.randint(0, 4) for _ in range(k)), reverse=True)
        else:
            lps = sorted((-rng.uniform(0.0, 3.0) for _ in range(k)), reverse=True)
        levels.append(list(zip(tokens, lps, strict=True)))
    return levels


def ranked_prefixes(levels: Sequence[Level]) -> list[tuple[float, int, tuple[int, ...]]]:
    """Every non-empty rank prefix with its key ``(-score, depth, ranks)``, best first."""
    keyed = []
    for d in range(1, len(levels) + 1):
        for ranks in itertools.product(*(range(len(level)) for level in levels[:d])):
            score = 0.0
            for j, i in enumerate(ranks):  # the same left-to-right sum as the tree's paths
                score += levels[j][i][1]
            keyed.append((-score, d, ranks))
    return sorted(keyed)


def token_path(levels: Sequence[Level], ranks: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(levels[j][i][0] for j, i in enumerate(ranks))


def brute_force_tree(root: int, levels: Sequence[Level], budget: int) -> DraftTree:
    """The ``budget - 1`` best prefixes, slots in key order, each parent looked up by ranks."""
    chosen = ranked_prefixes(levels)[: budget - 1]
    slot: dict[tuple[int, ...], int] = {(): 0}
    tokens, parents, log_probs = [root], [-1], [0.0]
    for neg_score, _, ranks in chosen:
        slot[ranks] = len(tokens)
        parents.append(slot[ranks[:-1]])  # KeyError if the chosen set were not a tree
        tokens.append(levels[len(ranks) - 1][ranks[-1]][0])
        log_probs.append(-neg_score)
    return DraftTree(tuple(tokens), tuple(parents), tuple(log_probs))


def node_paths(tree: DraftTree) -> dict[tuple[int, ...], float]:
    """Token path after the root of every slot -> its log-prob."""
    return {tuple(tree_paths_tokens(tree, s)[1:]): tree.log_probs[s] for s in range(len(tree))}


def check_shape(tree: DraftTree, budget: int) -> None:
    geometry = require_tree(tree.parents)
    assert len(tree) <= budget
    assert all(p < s for s, p in enumerate(tree.parents) if s)
    for children in geometry.children:  # never two siblings with the same token
        sibling_tokens = [tree.tokens[c] for c in children]
        assert len(sibling_tokens) == len(set(sibling_tokens))


# --- best_first_tree ---------------------------------------------------------------------


def test_best_first_tree_equals_brute_force() -> None:
    rng = random.Random(1234)
    for _ in range(400):
        levels = random_candidates(rng, rng.randint(1, 4))
        total = len(ranked_prefixes(levels)) + 1
        budget = rng.randint(1, total + 2)
        tree = best_first_tree(7, levels, budget)
        assert tree == brute_force_tree(7, levels, budget)
        assert len(tree) == min(budget, total)
        check_shape(tree, budget)


def test_best_prefixes_are_prefix_closed() -> None:
    """The claim that makes the best ``n`` prefixes a tree, checked exhaustively on random
    sets: in the key order every prefix comes after its parent, so every leading run of
    the order is closed under taking prefixes."""
    rng = random.Random(99)
    for _ in range(200):
        levels = random_candidates(rng, rng.randint(1, 4))
        order = {ranks: i for i, (_, _, ranks) in enumerate(ranked_prefixes(levels))}
        for ranks, i in order.items():
            if len(ranks) > 1:
                assert order[ranks[:-1]] < i
        for n in range(len(order) + 1):
            chosen = {ranks for ranks, i in order.items() if i < n}
            assert all(r[:-1] in chosen for r in chosen if len(r) > 1)


def test_slots_are_in_pop_order_best_first() -> None:
    lp = math.log
    levels = [[(5, lp(0.6)), (6, lp(0.25))], [(7, lp(0.5)), (8, lp(0.4))]]
    tree = best_first_tree(1, levels, 5)
    # probabilities: (5) .6, (5, 7) .3, (6) .25, (5, 8) .24, then (6, 7) .125 (left out)
    assert tree.tokens == (1, 5, 7, 6, 8)
    assert tree.parents == (-1, 0, 1, 0, 1)
    assert list(tree.log_probs[1:]) == sorted(tree.log_probs[1:], reverse=True)


def test_ties_prefer_shallower_then_lower_ranks() -> None:
    # every log-prob 0.0: all prefixes tie on score; depth, then ranks decide (BFS order)
    levels = [[(3, 0.0), (4, 0.0)], [(5, 0.0), (6, 0.0)]]
    tree = best_first_tree(1, levels, 7)
    assert tree.tokens == (1, 3, 4, 5, 6, 5, 6)
    assert tree.parents == (-1, 0, 0, 1, 1, 2, 2)


def test_budget_one_is_the_root_only() -> None:
    levels = [[(3, -0.1)]]
    for branch in (None, [3, 4]):
        tree = best_first_tree(9, levels, 1, branch=branch)
        assert (tree.tokens, tree.parents, tree.log_probs) == ((9,), (-1,), (0.0,))
    assert len(best_first_tree(9, [], 1)) == 1


def test_budget_larger_than_every_prefix_takes_them_all() -> None:
    levels = [[(3, -0.1), (4, -0.2)], [(5, -0.3)]]
    tree = best_first_tree(9, levels, MAX_SLOTS)
    assert len(tree) == 1 + 2 + 2


def test_deep_budget_at_max_slots() -> None:
    levels = [[(t, -0.01 * t) for t in range(8)] for _ in range(12)]
    tree = best_first_tree(0, levels, MAX_SLOTS)
    assert len(tree) == MAX_SLOTS
    check_shape(tree, MAX_SLOTS)


def test_branch_is_whole_shares_nodes_and_counts_in_the_budget() -> None:
    lp = math.log
    levels = [[(5, lp(0.6)), (6, lp(0.3))], [(7, lp(0.5)), (8, lp(0.4))], [(9, lp(0.9))]]
    tree = best_first_tree(1, levels, 6, branch=[5, 8, 3, 4])
    # budget // 2 = 3 branch tokens, slots 1..3; best-first (5,) reuses slot 1
    assert tree.tokens == (1, 5, 8, 3, 7, 6)
    assert tree.parents == (-1, 0, 1, 2, 1, 0)
    assert tree.log_probs[3] == -math.inf  # 3 is not a depth-3 candidate
    assert tree.log_probs[2] == lp(0.6) + lp(0.4)
    assert tree_paths_tokens(tree, 3) == [1, 5, 8, 3]


def test_branch_against_brute_force() -> None:
    """The tree = the branch chain united with the longest run of best prefixes that fits."""
    rng = random.Random(77)
    for _ in range(300):
        levels = random_candidates(rng, rng.randint(1, 4), vocab=4)
        ranked = ranked_prefixes(levels)
        budget = rng.randint(1, len(ranked) + 3)
        branch = [rng.randrange(4) for _ in range(rng.randint(0, 5))]
        tree = best_first_tree(2, levels, budget, branch=branch)
        check_shape(tree, budget)
        kept = branch[: budget // 2]
        assert list(tree.tokens[1 : 1 + len(kept)]) == kept
        assert tree.parents[1 : 1 + len(kept)] == tuple(range(len(kept)))
        expected = {tuple(kept[:d]) for d in range(len(kept) + 1)}
        for _, _, ranks in ranked:
            grown = expected | {token_path(levels, ranks)}
            if len(grown) > budget:
                break
            expected = grown
        paths = node_paths(tree)
        assert set(paths) == expected
        for _, _, ranks in ranked:  # every shared path carries the candidates' score
            path = token_path(levels, ranks)
            if path in paths:
                assert paths[path] == sum(levels[j][i][1] for j, i in enumerate(ranks))


# --- chain_tree / paths ------------------------------------------------------------------


def test_chain_tree_and_paths() -> None:
    tree = chain_tree(4, [5, 6, 7], log_probs=[-0.5, -0.25, 0.0])
    assert tree.parents == (-1, 0, 1, 2)
    assert tree.log_probs == (0.0, -0.5, -0.75, -0.75)
    assert tree.geometry().is_chain
    assert tree_path(tree, 2) == [0, 1, 2]
    assert tree_paths_tokens(tree, 3) == [4, 5, 6, 7]
    assert chain_tree(4, []).tokens == (4,)
    assert chain_tree(4, [1, 2]).log_probs == (0.0, 0.0, 0.0)


# --- accept_tree -------------------------------------------------------------------------


def naive_accept(tree: DraftTree, target: Sequence[int]) -> tuple[int, list[int]]:
    """Recursive walk: children of an accepted node that equal the target's token after it."""
    children: dict[int, list[int]] = {}
    for s in range(1, len(tree)):
        children.setdefault(tree.parents[s], []).append(s)
    found: list[tuple[int, int, list[int]]] = []

    def walk(u: int, path: list[int]) -> None:
        found.append((-len(path), u, path))
        for c in children.get(u, []):
            if tree.tokens[c] == target[u]:
                walk(c, [*path, c])

    walk(0, [0])
    _, u, path = min(found)
    return u, path


def test_accept_star() -> None:
    star = DraftTree((1, 3, 4, 5), (-1, 0, 0, 0), (0.0, -1.0, -1.0, -1.0))
    assert accept_tree(star, [4, 0, 0, 0]) == (2, [0, 2])
    assert accept_tree(star, [9, 3, 4, 5]) == (0, [0])


def test_accept_deep_and_mixed() -> None:
    deep = chain_tree(1, [2, 3, 4, 5])
    assert accept_tree(deep, [2, 3, 9, 5, 0]) == (2, [0, 1, 2])
    assert accept_tree(deep, [2, 3, 4, 5, 6]) == (4, [0, 1, 2, 3, 4])
    #      0(1)
    #     /    \
    #   1(2)   2(3)
    #    |      |
    #   3(4)   4(5)
    #           |
    #          5(6)
    mixed = DraftTree((1, 2, 3, 4, 5, 6), (-1, 0, 0, 1, 2, 4), (0.0,) * 6)
    assert accept_tree(mixed, [3, 4, 5, 0, 6, 0]) == (5, [0, 2, 4, 5])
    assert accept_tree(mixed, [2, 4, 5, 0, 6, 0]) == (3, [0, 1, 3])
    # slot 5 matches its parent's target, but slot 4 does not: 5 is not accepted
    assert accept_tree(mixed, [3, 0, 9, 0, 6, 0]) == (2, [0, 2])


def test_accept_tie_goes_to_the_lowest_slot() -> None:
    # duplicate sibling tokens (best_first_tree never builds this) make two accepted leaves
    dup = DraftTree((1, 2, 2, 3, 3), (-1, 0, 0, 2, 1), (0.0,) * 5)
    assert accept_tree(dup, [2, 3, 3, 0, 0]) == (3, [0, 2, 3])


def test_accept_chain_equals_leading_accepted() -> None:
    rng = random.Random(5)
    for _ in range(500):
        n = rng.randint(1, 9)
        d = [rng.randrange(3) for _ in range(n)]
        t = [rng.randrange(3) for _ in range(n)]
        u, path = accept_tree(chain_tree(d[0], d[1:]), t)
        assert u == leading_accepted(d, t) - 1
        assert path == list(range(u + 1))


def test_accept_random_trees_against_naive_recursion() -> None:
    rng = random.Random(6)
    for _ in range(500):
        n = rng.randint(1, 14)
        parents = [-1] + [rng.randrange(s) for s in range(1, n)]
        tokens = [rng.randrange(3) for _ in range(n)]
        tree = DraftTree(tuple(tokens), tuple(parents), (0.0,) * n)
        target = [rng.randrange(3) for _ in range(n)]
        assert accept_tree(tree, target) == naive_accept(tree, target)


# --- SyntheticTreeDrafter (SYNTHETIC) ------------------------------------------------------

V = 64
ORACLE = [random.Random(0).randrange(V) for _ in range(3000)]


def oracle_rank(level: Level, correct: int) -> int | None:
    tokens = [t for t, _ in level]
    return tokens.index(correct) if correct in tokens else None


def test_synthetic_rank_frequencies_match_rank_probs() -> None:
    rank_probs = [0.5, 0.2, 0.1]
    k, depths = 2, 3  # rank 2 lies past k: the oracle token is then absent
    counts = {0: 0, 1: 0, None: 0}
    draws = 0
    for seed in range(4):
        drafter = SyntheticTreeDrafter(ORACLE, rank_probs, V, seed=seed)
        for pos in range(0, 2000):
            levels = drafter.candidates(ORACLE[:pos], ORACLE[pos], depths, k)
            for d, level in enumerate(levels, start=1):
                assert len({t for t, _ in level}) == k  # distinct
                assert [lp for _, lp in level] == [math.log(p) for p in rank_probs[:k]]
                counts[oracle_rank(level, ORACLE[pos + d])] += 1
                draws += 1
    radius = hoeffding_radius(draws)
    assert abs(counts[0] / draws - 0.5) < radius
    assert abs(counts[1] / draws - 0.2) < radius
    assert abs(counts[None] / draws - 0.3) < radius


def test_synthetic_tree_expected_acceptance_is_calibrated() -> None:
    """E[accepted depth] = sum of exp(log_prob) over non-root slots (the drafter is
    calibrated and siblings are distinct); the tree's shape is the same at every position."""
    drafter = SyntheticTreeDrafter(ORACLE, [0.55, 0.25, 0.1], V, seed=3)
    depths, total, n = 4, 0, 2500
    expected: float | None = None
    for pos in range(n):
        tree = drafter.tree(ORACLE[:pos], ORACLE[pos], 12, depths, 3)
        value = math.fsum(math.exp(lp) for lp in tree.log_probs[1:])
        assert expected is None or math.isclose(value, expected)
        expected = value
        geometry = tree.geometry()
        target = []  # the oracle's next token after an all-correct path, else any token
        for s in range(len(tree)):
            path = tree_paths_tokens(tree, s)
            on_oracle = path == ORACLE[pos : pos + len(path)]
            target.append(ORACLE[pos + len(path)] if on_oracle else V - 1)
        u, _ = accept_tree(tree, target)
        total += geometry.depth[u]
    assert expected is not None
    assert abs(total / n - expected) < hoeffding_radius(n, spread=depths)


def test_synthetic_is_deterministic_and_history_free() -> None:
    a = SyntheticTreeDrafter(ORACLE, [0.6, 0.3], V, seed=11)
    b = SyntheticTreeDrafter(ORACLE, [0.6, 0.3], V, seed=11)
    first = a.candidates(ORACLE[:40], ORACLE[40], 5, 2)
    for pos in range(10):  # other calls in between change nothing
        a.candidates(ORACLE[:pos], ORACLE[pos], 3, 2)
    assert a.candidates(ORACLE[:40], ORACLE[40], 5, 2) == first
    assert b.candidates(ORACLE[:40], ORACLE[40], 5, 2) == first
    assert b.candidates(ORACLE[:40], ORACLE[40], 3, 2) == first[:3]
    other = SyntheticTreeDrafter(ORACLE, [0.6, 0.3], V, seed=12)
    assert other.candidates(ORACLE[:40], ORACLE[40], 5, 2) != first


def test_synthetic_past_the_oracle_end_is_random_and_distinct() -> None:
    seen: set[int] = set()
    for seed in range(20):
        drafter = SyntheticTreeDrafter([1, 2, 3], [0.4, 0.3, 0.2], 4, seed=seed)
        levels = drafter.candidates([1, 2], 3, 3, 3)  # every depth lies past the oracle
        for level in levels:
            tokens = {t for t, _ in level}
            assert len(tokens) == 3
            seen |= tokens
    assert seen == {0, 1, 2, 3}


# --- typed errors --------------------------------------------------------------------------

GOOD: list[Level] = [[(3, -0.1), (4, -0.2)]]


@pytest.mark.parametrize(
    ("root", "candidates", "budget", "branch", "shown"),
    [
        (1, GOOD, 0, None, "(got 0)"),
        (1, GOOD, MAX_SLOTS + 1, None, f"(got {MAX_SLOTS + 1})"),
        (1, GOOD, True, None, "(got True)"),
        (1, GOOD, 2.0, None, "(got 2.0)"),
        (-1, GOOD, 2, None, "(got -1)"),
        ("a", GOOD, 2, None, "(got 'a')"),
        (1, "abc", 2, None, "(got str)"),
        (1, [], 2, None, "'candidates' is empty"),
        (1, [[]], 2, None, "'candidates[0]'"),
        (1, [[(1,)]], 2, None, "(got (1,))"),
        (1, [[(1, 0.5)]], 2, None, "(got 0.5)"),
        (1, [[(1, math.nan)]], 2, None, "(got nan)"),
        (1, [[(1, math.inf)]], 2, None, "(got inf)"),
        (1, [[(1, -math.inf)]], 2, None, "(got -inf)"),
        (1, [[(1, "x")]], 2, None, "(got 'x')"),
        (1, [[(1, True)]], 2, None, "(got True)"),
        (1, [[(-2, -0.1)]], 2, None, "(got -2)"),
        (1, [[(1.0, -0.1)]], 2, None, "(got 1.0)"),
        (1, [[(True, -0.1)]], 2, None, "(got True)"),
        (1, [[(1, -1.0), (1, -2.0)]], 2, None, "token 1 appears twice"),
        (1, [[(1, -2.0), (2, -1.0)]], 2, None, "must be best first"),
        (1, GOOD, 2, [-1], "(got -1)"),
        (1, GOOD, 2, "ab", "(got str)"),
        (1, GOOD, 2, 5, "(got int)"),
    ],
)
def test_best_first_tree_rejects(
    root: object, candidates: object, budget: object, branch: object, shown: str
) -> None:
    with pytest.raises(DraftArgumentError, match=re.escape(shown)):
        best_first_tree(root, candidates, budget, branch=branch)  # type: ignore[arg-type]  # bad inputs on purpose


@pytest.mark.parametrize(
    ("fields", "shown"),
    [
        (((), (), ()), "same length >= 1"),
        (((1, 2), (-1,), (0.0, 0.0)), "(got 2, 1, 2)"),
        (((1, 2), (-1, 1), (0.0, 0.0)), "slot 1 must name an earlier slot"),
        (((1, -2), (-1, 0), (0.0, 0.0)), "(got -2)"),
        (((1, 2), (-1, 0), (0.0, 0.5)), "(got 0.5)"),
        (((1, 2), (-1, 0), (0.0, math.nan)), "(got nan)"),
        (((1, 2), (-1, 0), (-0.5, -0.5)), "(got -0.5)"),
        (("ab", (-1, 0), (0.0, 0.0)), "(got str)"),
    ],
)
def test_draft_tree_rejects(fields: tuple[object, object, object], shown: str) -> None:
    with pytest.raises(DraftArgumentError, match=re.escape(shown)):
        DraftTree(*fields)  # type: ignore[arg-type]  # bad inputs on purpose


def test_paths_and_acceptance_reject() -> None:
    tree = chain_tree(1, [2, 3])
    for u in (-1, 3, True, "0"):
        with pytest.raises(DraftArgumentError, match=re.escape(f"(got {u!r})")):
            tree_paths_tokens(tree, u)  # type: ignore[arg-type]  # bad inputs on purpose
    with pytest.raises(DraftArgumentError, match=re.escape("3 (got 2)")):
        accept_tree(tree, [2, 3])
    with pytest.raises(DraftArgumentError, match=re.escape("(got -4)")):
        accept_tree(tree, [2, 3, -4])
    with pytest.raises(DraftArgumentError, match=re.escape("(got tuple)")):
        accept_tree((1, 2), [2, 3])  # type: ignore[arg-type]  # bad inputs on purpose
    with pytest.raises(DraftArgumentError, match=re.escape("(got 0.5)")):
        chain_tree(1, [2], log_probs=[0.5])
    with pytest.raises(DraftArgumentError, match=re.escape("(got [-0.5, -0.5])")):
        chain_tree(1, [2], log_probs=[-0.5, -0.5])
    with pytest.raises(DraftArgumentError, match=re.escape("(got -3)")):
        chain_tree(1, [2, -3])


@pytest.mark.parametrize(
    ("kwargs", "shown"),
    [
        ({"rank_probs": []}, "(got [])"),
        ({"rank_probs": [0.5, 0.0]}, "(got 0.0)"),
        ({"rank_probs": [0.2, 0.3]}, "rank_probs[1]=0.3"),
        ({"rank_probs": [0.7, 0.6]}, "sum to at most 1"),
        ({"rank_probs": [True]}, "(got True)"),
        ({"vocab_size": 1}, "(got 1)"),
        ({"seed": -1}, "(got -1)"),
        ({"oracle": "abc"}, "(got str)"),
        ({"oracle": [1, 99]}, "(got 99)"),
    ],
)
def test_synthetic_constructor_rejects(kwargs: dict[str, object], shown: str) -> None:
    args: dict[str, object] = {"oracle": [1, 2, 3], "rank_probs": [0.5], "vocab_size": 8}
    args.update(kwargs)
    with pytest.raises(DraftArgumentError, match=re.escape(shown)):
        SyntheticTreeDrafter(**args)  # type: ignore[arg-type]  # bad inputs on purpose


def test_synthetic_candidates_reject() -> None:
    drafter = SyntheticTreeDrafter([1, 2, 0, 1], [0.5, 0.3], 3)
    for depth_count in (0, True):
        with pytest.raises(DraftArgumentError, match=re.escape(f"(got {depth_count!r})")):
            drafter.candidates([1], 2, depth_count, 1)
    for k in (0, 3):  # k at most min(len(rank_probs), vocab_size - 1) = 2
        with pytest.raises(DraftArgumentError, match=re.escape(f"(got {k})")):
            drafter.candidates([1], 2, 2, k)
    with pytest.raises(DraftArgumentError, match=re.escape("(got 5)")):
        drafter.candidates([1], 5, 2, 1)
    with pytest.raises(DraftArgumentError, match=re.escape("(got str)")):
        drafter.candidates("ab", 2, 2, 1)  # type: ignore[arg-type]  # bad inputs on purpose
    with pytest.raises(OracleMismatchError, match="oracle has 2"):
        drafter.candidates([1], 1, 2, 1)
