"""The operations DFlash2 adds to a DFlash drafter (``specs/dflash2.md`` §5.4, §5.6, §6).

- :func:`conv_deltas`: both sides' per-row, per-group kernel deltas of a grouped dynamic
  convolution, from one projection of the sublayer's normalised input;
- :func:`dynamic_conv`: the convolution itself over a block's rows, causal inside the
  block and zero before its first row (it never reads a previous block or a context row);
- :func:`candidates`: each slot's ``k`` candidate tokens and their unary scores (the
  logits scaled by ``output_multiplier``, then soft-capped), ordered by score descending,
  then token id ascending;
- :func:`selector_walk`: the candidate selector's left-to-right walk, each slot's choice
  scored by its unary score plus a rank-``R`` bilinear term between the previous choice's
  predecessor-codebook row and the candidate's successor-codebook row, modulated by the
  slot's projected hidden state. Greedy, or coupled to dflash's sampling rule: the
  candidate at slot ``j`` maximises ``score / T + G(seed, p0 + j, token)``, the target's
  own noise at that position and token (:mod:`dflash.sampling`);
- :func:`selector_tree`: the best-first draft tree of the selector's paths, each child's
  probability conditioned on its parent's token.

Everything is in float32 (the bilinear term, the unary maps and the walk) on the inputs'
device; plain torch, the reference the drafter's kernels will be checked against.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence

import torch
from torch import Tensor

from dflash.geometry import MAX_SLOTS
from dflash.kernels.sample_reference import gumbel_noise_at
from dflash.model.drafters.dflash_products import ranked_top_k
from dflash.model.drafters.errors import DraftArgumentError
from dflash.model.drafters.trees import DraftTree


def conv_deltas(s: Tensor, projection: Tensor, kernel_size: int, groups: int) -> Tensor:
    """``s: [..., Q, H]`` (a block's normalised sublayer input) and ``projection:
    [2 * kernel_size * groups, H]`` → ``[2, ..., Q, kernel_size, groups]``: side 0's
    deltas (before the sublayer) then side 1's (after it). The projection's output index
    is ``side * kernel_size * groups + tap * groups + group``."""
    if projection.shape[0] != 2 * kernel_size * groups:
        raise ValueError(
            f"'projection' must have 2 * kernel_size * groups = {2 * kernel_size * groups} "
            f"rows (got {projection.shape[0]})"
        )
    p = s.to(projection.dtype) @ projection.T                 # [..., Q, 2 Kc NG]
    p = p.view(*p.shape[:-1], 2, kernel_size, groups)         # [..., Q, 2, Kc, NG]
    return p.movedim(-3, 0)


def dynamic_conv(z: Tensor, base: Tensor, delta: Tensor) -> Tensor:
    """One side of the grouped dynamic convolution over a block's rows.

    ``z: [..., Q, H]`` the rows, ``base: [Kc, H]`` the side's base kernel, ``delta:
    [..., Q, Kc, NG]`` its deltas (channel ``ch`` uses group ``ch // (H / NG)``) →
    ``[..., Q, H]`` in z's dtype::

        out[j, ch] = sum_{t < Kc, t <= j} (base[t, ch] + delta[j, t, ch // G]) * z[j - t, ch]

    Tap 0 is the row itself; rows before the block's first are zeros. Computed in float32.
    """
    q, h = z.shape[-2], z.shape[-1]
    kc, groups = delta.shape[-2], delta.shape[-1]
    if base.shape != (kc, h) or h % groups:
        raise ValueError(
            f"'base' must be [Kc={kc}, H={h}] and the groups ({groups}) must divide H "
            f"(got base {tuple(base.shape)})"
        )
    w = base.float() + delta.float().repeat_interleave(h // groups, dim=-1)   # [..., Q, Kc, H]
    zf = z.float()
    out = torch.zeros_like(zf)
    for t in range(min(kc, q)):
        out[..., t:, :] += w[..., t:, t, :] * zf[..., : q - t, :]
    return out.to(z.dtype)


def unary_scores(logits: Tensor, multiplier: float, cap: float | None) -> Tensor:
    """``softcap(multiplier * logits)`` in float32 (``cap * tanh(x / cap)``; no cap when
    ``cap`` is None): the multiplier first, then the cap."""
    x = logits.float() * multiplier
    return x if cap is None else cap * torch.tanh(x / cap)


def candidates(logits: Tensor, k: int, multiplier: float,
               cap: float | None) -> tuple[Tensor, Tensor]:
    """``logits: [Q, V]`` → ``(scores [Q, k] float32, ids [Q, k] int64)``: each row's
    ``k`` best tokens by logit, descending, ties by ascending token id, and their
    :func:`unary_scores` (both maps increase when ``multiplier > 0``, so the order is the
    logits')."""
    if not 1 <= k <= logits.shape[-1]:
        raise ValueError(f"'k' must be in [1, {logits.shape[-1]}] (got {k})")
    if not multiplier > 0:
        raise ValueError(f"'multiplier' must be > 0 (got {multiplier})")
    values = logits.float()
    ids = ranked_top_k(values, k)  # the k best in O(V), without a host read
    return unary_scores(values.gather(-1, ids), multiplier, cap), ids


def selector_walk(
    scores: Tensor,
    ids: Tensor,
    hidden: Tensor,
    predecessor: Tensor,
    successor: Tensor,
    anchor: int | Tensor,
    *,
    temperature: float = 0.0,
    seed: int = 0,
    start: int | Tensor = 0,
) -> Tensor:
    """The selector's choices for ``Q`` slots, left to right: ``[Q]`` int64 token ids on
    the inputs' device, computed there without a host read (a CUDA graph can hold it).

    ``scores, ids: [Q, k]`` (:func:`candidates`), ``hidden: [Q, R]`` the slots' projected
    hidden states, ``predecessor, successor: [V, R]`` the codebooks; slot 0's predecessor
    is ``anchor`` (an int, or a one-element tensor on the device) and slot ``j``'s the
    token chosen at ``j - 1``. Slot ``j`` scores its candidate ``c`` as ``scores[j, c] +
    sum_r predecessor[prev, r] * hidden[j, r] * successor[ids[j, c], r]`` and takes the
    first maximum (``temperature`` 0), or the first maximum of ``score * (1 / T) +
    G(seed, start + j, ids[j, c])`` (``1 / T`` rounded to float32, as the target's rule
    scales its logits): the target's noise at the slot's absolute position ``start + j``
    (``start`` an int or a one-element tensor) and the candidate's token.
    """
    q = scores.shape[0]
    if ids.shape != scores.shape or hidden.shape[0] != q:
        raise ValueError(
            f"'scores', 'ids' and 'hidden' must agree on the slots (got {tuple(scores.shape)}, "
            f"{tuple(ids.shape)}, {tuple(hidden.shape)})"
        )
    if isinstance(anchor, int) and not 0 <= anchor < predecessor.shape[0]:
        raise ValueError(f"'anchor' must be a token id in [0, {predecessor.shape[0]}) "
                         f"(got {anchor})")
    device = ids.device
    prev = torch.as_tensor(anchor, dtype=torch.int64, device=device).reshape(1)
    a, s, e = predecessor.float(), successor.float(), hidden.float()
    sampled = temperature > 0
    if sampled:
        inv_t = float(torch.tensor(1.0 / temperature, dtype=torch.float32))
        first = torch.as_tensor(start, dtype=torch.int64, device=device).reshape(1)
        noise = gumbel_noise_at(seed, first + torch.arange(q, device=device), ids)   # [Q, k]
    chosen = []
    for j in range(q):
        edge = (a.index_select(0, prev) * e[j : j + 1]) @ s[ids[j]].T            # [1, k]
        score = scores[j : j + 1] + edge
        if sampled:
            score = score * inv_t + noise[j : j + 1]
        prev = ids[j].gather(0, score.argmax(-1))                                # the first maximum
        chosen.append(prev)
    return torch.cat(chosen)


def selector_tree(
    root: int,
    scores: Tensor,
    ids: Tensor,
    hidden: Tensor,
    predecessor: Tensor,
    successor: Tensor,
    budget: int,
    *,
    branch: Sequence[int] | None = None,
) -> DraftTree:
    """The draft tree of the selector's ``budget`` best paths (root included) by joint
    log-probability, each step's probabilities conditioned on the path's previous token.

    A node at depth ``d`` holding token ``x`` (the root: ``root`` at depth 0) has as
    children slot ``d``'s candidates ``ids[d]``, with log-probabilities
    ``log_softmax(scores[d] + edge_d(x))`` — the selector's own distribution at
    temperature 1 given that predecessor, so the tree's branches follow the dependencies
    the selector was trained on (a v1 tree's per-depth candidates cannot). Nodes are taken
    best joint score first (ties: shallower, then earlier pushed) from a heap holding every
    child of every node taken; a parent is always taken before its children. ``branch``
    (the proposal's path when the target samples, or a copy from the context): its first
    ``budget // 2`` tokens go in first as a chain from the root, scored the same way
    (``-inf`` from a token outside its slot's candidates on); a node equal to a branch
    node (same parent, same token) is not taken twice. Depth is at most ``Q``.
    """
    q = ids.shape[0]
    if isinstance(budget, bool) or not isinstance(budget, int) or not 1 <= budget <= MAX_SLOTS:
        raise DraftArgumentError(
            f"'budget' must be an int in [1, MAX_SLOTS={MAX_SLOTS}] (got {budget!r})"
        )
    a, s_book, e = predecessor.float(), successor.float(), hidden.float()
    id_rows = ids.tolist()

    def child_log_probs(depth: int, token: int) -> list[float]:
        """Slot ``depth``'s candidates' log-probabilities after ``token``."""
        edge = (a[token] * e[depth]) @ s_book[ids[depth]].T
        return torch.log_softmax(scores[depth].float() + edge, -1).tolist()

    tokens, parents, log_probs, depths = [root], [-1], [0.0], [0]
    taken: set[tuple[int, int]] = set()   # (parent slot, token)
    for token in list(branch or [])[: budget // 2]:
        d = depths[-1]
        if d >= q:
            break
        lps = child_log_probs(d, tokens[-1])
        lp = lps[id_rows[d].index(token)] if token in id_rows[d] else -math.inf
        taken.add((len(tokens) - 1, token))
        tokens.append(int(token))
        parents.append(len(tokens) - 2)
        log_probs.append(log_probs[-1] + lp)
        depths.append(d + 1)
    heap: list[tuple[float, int, int, int, int]] = []   # (-score, depth, order, parent, token)
    order = 0

    def push_children(slot: int) -> None:
        nonlocal order
        d = depths[slot]
        if d >= q:
            return
        for c, lp in enumerate(child_log_probs(d, tokens[slot])):
            heapq.heappush(heap, (-(log_probs[slot] + lp), d + 1, order, slot, id_rows[d][c]))
            order += 1

    for slot in range(len(tokens)):
        push_children(slot)
    while heap and len(tokens) < budget:
        neg, d, _, parent, token = heapq.heappop(heap)
        if (parent, token) in taken:
            continue
        taken.add((parent, token))
        tokens.append(token)
        parents.append(parent)
        log_probs.append(-neg)
        depths.append(d)
        push_children(len(tokens) - 1)
    return DraftTree(tokens=tuple(tokens), parents=tuple(parents), log_probs=tuple(log_probs))


__all__ = ["candidates", "conv_deltas", "dynamic_conv", "selector_tree", "selector_walk",
           "unary_scores"]
