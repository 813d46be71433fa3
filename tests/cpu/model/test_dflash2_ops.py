"""DFlash2's operations (``dflash.model.drafters.dflash2_ops``) against their definitions in
``specs/dflash2.md``: the deltas' layout, the grouped dynamic convolution (causal inside
the block, never across blocks), the candidates' order and unary maps, and the selector's
walk, greedy and coupled to the target's sampling rule."""

from __future__ import annotations

import math

import pytest
import torch

from dflash.kernels.sample_reference import gumbel_argmax_reference
from dflash.model.drafters.dflash2_ops import (
    candidates,
    conv_deltas,
    dynamic_conv,
    selector_tree,
    selector_walk,
    unary_scores,
)

GEN = torch.Generator().manual_seed(0)


def rnd(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=GEN)


def test_deltas_are_read_side_tap_group() -> None:
    Q, H, KC, NG = 5, 8, 3, 4
    s, w = rnd(Q, H), rnd(2 * KC * NG, H)
    d = conv_deltas(s, w, KC, NG)
    assert d.shape == (2, Q, KC, NG)
    p = s @ w.T
    for side in range(2):
        for t in range(KC):
            for g in range(NG):
                assert torch.equal(d[side, :, t, g], p[:, side * KC * NG + t * NG + g])
    with pytest.raises(ValueError, match="2 \\* kernel_size \\* groups = 24"):
        conv_deltas(s, w[:-1], KC, NG)


def brute_conv(z: torch.Tensor, base: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    Q, H = z.shape
    KC, NG = delta.shape[-2:]
    G = H // NG
    out = torch.zeros(Q, H, dtype=torch.float64)
    for j in range(Q):
        for ch in range(H):
            for t in range(KC):
                if j - t >= 0:
                    w = float(base[t, ch]) + float(delta[j, t, ch // G])
                    out[j, ch] += w * float(z[j - t, ch])
    return out


@pytest.mark.parametrize(("Q", "KC"), [(6, 2), (4, 3), (2, 4)])
def test_conv_matches_its_definition(Q: int, KC: int) -> None:
    H, NG = 8, 2
    z, base, delta = rnd(Q, H), rnd(KC, H), rnd(Q, KC, NG)
    got = dynamic_conv(z, base, delta)
    assert torch.allclose(got.double(), brute_conv(z, base, delta), atol=1e-5)


def test_conv_never_reads_another_block_nor_a_later_row() -> None:
    """Two blocks side by side: the second's rows do not move when the first changes, and
    a row does not move when a later row of its own block changes."""
    Q, H, KC, NG = 5, 8, 2, 4
    z, base, delta = rnd(2, Q, H), rnd(KC, H), rnd(2, Q, KC, NG)
    out = dynamic_conv(z, base, delta)
    z2 = z.clone()
    z2[0] = rnd(Q, H)
    assert torch.equal(dynamic_conv(z2, base, delta)[1], out[1])
    z3 = z.clone()
    z3[1, 3:] = rnd(Q - 3, H)
    assert torch.equal(dynamic_conv(z3, base, delta)[1, :3], out[1, :3])
    # row 0 of a block is tap 0 alone
    w0 = base[0] + delta[1, 0, 0].repeat_interleave(H // NG)
    assert torch.allclose(out[1, 0], w0 * z[1, 0])


def test_a_group_delta_moves_its_channels_only() -> None:
    Q, H, KC, NG = 3, 8, 2, 4
    z, base, delta = rnd(Q, H), rnd(KC, H), rnd(Q, KC, NG)
    out = dynamic_conv(z, base, delta)
    moved = delta.clone()
    moved[2, 1, 1] += 1.0
    diff = (dynamic_conv(z, base, moved) - out).abs() > 0
    assert diff[2, 2:4].all() and diff.sum() == 2  # group 1 = channels 2, 3, row 2 only


def test_candidates_are_ordered_by_logit_then_id() -> None:
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.5, 3.0, 2.0]])
    scores, ids = candidates(logits, 4, 1.0, None)
    assert ids.tolist() == [[1, 2, 4, 5]]
    assert scores.tolist() == [[3.0, 3.0, 3.0, 2.0]]
    for bad in (0, 7):
        with pytest.raises(ValueError, match="'k' must be in \\[1, 6\\]"):
            candidates(logits, bad, 1.0, None)
    with pytest.raises(ValueError, match="'multiplier' must be > 0"):
        candidates(logits, 2, 0.0, None)


def test_the_multiplier_comes_before_the_cap() -> None:
    x = torch.tensor([10.0, -3.0, 0.5])
    got = unary_scores(x, 0.2, 1.5)
    want = 1.5 * torch.tanh(0.2 * x / 1.5)
    assert torch.allclose(got, want)
    assert not torch.allclose(got, 0.2 * 1.5 * torch.tanh(x / 1.5))  # cap first differs
    assert torch.equal(unary_scores(x, 2.0, None), 2.0 * x)


def test_the_greedy_walk_follows_the_bilinear_edges() -> None:
    """Slot 0's unary prefers token 2, but the edge from the anchor to token 5 outweighs
    it; slot 1's choice then depends on the predecessor chosen at slot 0."""
    V, R = 8, 2
    A, S = torch.zeros(V, R), torch.zeros(V, R)
    A[0] = torch.tensor([1.0, 0.0])     # anchor 0 likes successors with r0
    A[7] = torch.tensor([0.0, 1.0])     # anchor 7 likes successors with r1
    A[5] = torch.tensor([0.0, 1.0])
    S[5] = torch.tensor([3.0, 0.0])
    S[3] = torch.tensor([0.0, 3.0])
    scores = torch.tensor([[1.0, 0.5], [1.0, 0.5]])
    ids = torch.tensor([[2, 5], [4, 3]])
    e = torch.ones(2, R)
    assert selector_walk(scores, ids, e, A, S, anchor=0).tolist() == [5, 3]
    assert selector_walk(scores, ids, e, A, S, anchor=7).tolist() == [2, 4]
    assert selector_walk(scores, ids, torch.zeros(2, R), A, S, anchor=0).tolist() == [2, 4]
    tie = torch.tensor([[1.0, 1.0], [1.0, 1.0]])
    assert selector_walk(tie, ids, torch.zeros(2, R), A, S, anchor=0).tolist() == [2, 4]
    with pytest.raises(ValueError, match="'anchor' must be a token id"):
        selector_walk(scores, ids, e, A, S, anchor=V)


def test_a_coupled_walk_of_the_targets_own_scores_draws_the_targets_tokens() -> None:
    """With every token a candidate, no edge term, multiplier 1 and no cap, the coupled
    walk's choice at slot j is the target's sampled token at position start + j, seed for
    seed: a drafter whose distribution equals the target's is always accepted."""
    Q, V, R, start = 6, 40, 4, 123
    logits = rnd(Q, V) * 2
    scores, ids = candidates(logits, V, 1.0, None)
    zero = torch.zeros(Q, R)
    A, S = rnd(V, R), rnd(V, R)
    for seed in (0, 7, 2**40 + 3):
        for temp in (0.7, 1.0, 1.6):
            drafted = selector_walk(scores, ids, zero, A, S, anchor=1, temperature=temp,
                                    seed=seed, start=start).tolist()
            inv_t = float(torch.tensor(1.0 / temp, dtype=torch.float32))
            target = gumbel_argmax_reference(
                logits, torch.arange(start, start + Q), seed, inv_t).tolist()
            assert drafted == target, (seed, temp)
    one = selector_walk(scores, ids, zero, A, S, 1, temperature=1.0, seed=5, start=start)
    assert torch.equal(one, selector_walk(scores, ids, zero, A, S, 1, temperature=1.0,
                                          seed=5, start=torch.tensor([start])))
    others = {tuple(selector_walk(scores, ids, zero, A, S, 1, temperature=1.0, seed=s,
                                  start=start).tolist()) for s in range(8)}
    assert len(others) > 1


def test_coupled_draws_follow_the_selectors_softmax() -> None:
    """One slot, three candidates: over 4,000 seeds the draws' frequencies match
    softmax(score / T) (chi-square, 2 degrees of freedom, p > 0.001 at this fixed set)."""
    scores = torch.tensor([[1.0, 0.4, -0.5]])
    ids = torch.tensor([[3, 8, 1]])
    A, S, e = rnd(10, 2), rnd(10, 2), rnd(1, 2)
    edge = (A[0] * e[0]) @ S[ids[0]].T
    p = torch.softmax((scores[0] + edge) / 0.8, -1).tolist()
    counts = dict.fromkeys(ids[0].tolist(), 0)
    n = 4000
    for seed in range(n):
        counts[int(selector_walk(scores, ids, e, A, S, 0, temperature=0.8, seed=seed)[0])] += 1
    chi2 = sum((counts[t] - n * q) ** 2 / (n * q) for t, q in zip(ids[0].tolist(), p,
                                                                strict=True))
    assert chi2 < -2 * math.log(0.001), (counts, p)  # the chi-square(2) tail at p = 0.001


def _all_paths(scores: torch.Tensor, ids: torch.Tensor, e: torch.Tensor, A: torch.Tensor,
               S: torch.Tensor, root: int) -> dict[tuple[int, ...], float]:
    """Every path of candidates from the root (depth 1..Q) and its joint log-probability,
    by brute force."""
    out: dict[tuple[int, ...], float] = {}

    def walk(path: tuple[int, ...], prev: int, lp: float) -> None:
        d = len(path)
        if d == ids.shape[0]:
            return
        cond = torch.log_softmax(scores[d] + (A[prev] * e[d]) @ S[ids[d]].T, -1)
        for c in range(ids.shape[1]):
            tok = int(ids[d, c])
            out[(*path, tok)] = lp + float(cond[c])
            walk((*path, tok), tok, lp + float(cond[c]))

    walk((), root, 0.0)
    return out


def _paths_of(tree: object) -> dict[tuple[int, ...], float]:
    tokens, parents, lps = tree.tokens, tree.parents, tree.log_probs  # type: ignore[attr-defined]  # a DraftTree
    out = {}
    for s in range(1, len(tokens)):
        path, node = [], s
        while node > 0:
            path.append(tokens[node])
            node = parents[node]
        out[tuple(reversed(path))] = lps[s]
    return out


@pytest.mark.parametrize("budget", [1, 2, 5, 13, 40])
def test_the_selector_tree_holds_the_best_paths(budget: int) -> None:
    """The tree's nodes are the budget - 1 best paths by joint log-probability under the
    selector's conditional distributions (every path enumerated), each with its score;
    parents precede children; never deeper than the slots."""
    Q, k, V, R = 3, 3, 12, 4
    scores, ids = rnd(Q, k), torch.stack([torch.randperm(V, generator=GEN)[:k] for _ in range(Q)])
    e, A, S = rnd(Q, R), rnd(V, R), rnd(V, R)
    tree = selector_tree(7, scores, ids, e, A, S, budget)
    assert tree.tokens[0] == 7 and len(tree.tokens) == min(budget, 1 + 3 + 9 + 27)
    assert all(p < s for s, p in enumerate(tree.parents) if s)
    every = _all_paths(scores, ids, e, A, S, 7)
    got = _paths_of(tree)
    for path, lp in got.items():
        assert math.isclose(lp, every[path], rel_tol=1e-5, abs_tol=1e-6), path
    best = sorted(every.values(), reverse=True)[: len(got)]
    assert sorted(got.values(), reverse=True) == pytest.approx(best, rel=1e-5, abs=1e-6)


def test_a_branch_goes_in_first_and_is_scored() -> None:
    Q, k, V, R = 3, 2, 10, 3
    scores, ids = rnd(Q, k), torch.tensor([[1, 2], [3, 4], [5, 6]])
    e, A, S = rnd(Q, R), rnd(V, R), rnd(V, R)
    tree = selector_tree(0, scores, ids, e, A, S, 8, branch=[2, 9, 5])
    assert tree.tokens[1:3] == (2, 9) and tree.parents[1:3] == (0, 1)  # budget // 2 = 4
    every = _all_paths(scores, ids, e, A, S, 0)
    assert math.isclose(tree.log_probs[1], every[(2,)], rel_tol=1e-5)
    assert tree.log_probs[2] == -math.inf            # 9 is not a slot-1 candidate
    assert len(set(zip(tree.parents, tree.tokens, strict=True))) == len(tree.tokens)
    with pytest.raises(Exception, match="'budget' must be an int in"):
        selector_tree(0, scores, ids, e, A, S, 0)


def test_candidates_are_exact_under_many_ties_and_signed_zeros() -> None:
    """Logits from a handful of values (ties everywhere, -0.0 and +0.0 mixed), every k:
    the candidates are the definition's, a sort of (logit descending, id ascending)."""
    gen = torch.Generator().manual_seed(0)
    for _ in range(200):
        y = torch.randint(-3, 4, (4, 40), generator=gen).float() * 0.5
        zero = y == 0
        y[zero] = torch.where(torch.rand(int(zero.sum()), generator=gen) < 0.5, -0.0, 0.0)
        k = int(torch.randint(1, 41, (1,), generator=gen))
        _, ids = candidates(y, k, 1.0, None)
        for r, row in enumerate(y.tolist()):
            want = sorted(range(40), key=lambda v: (-row[v], v))[:k]
            assert ids[r].tolist() == want
