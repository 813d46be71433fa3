"""The DFlash training objective: many anchored blocks per sequence in one forward.

For a sequence ``ids [S]`` with the frozen target's tap features ``features [S, F]`` and
anchors ``a_1 … a_A`` (positions whose token is given; the block's other ``B-1`` slots are
the mask token)::

    keys   = [ context rows 0 … S-1 ; block 1 (B rows) ; … ; block A (B rows) ]
    block j, slot k: position a_j + k, sees context rows < a_j and the rows of block j only
                     (plus each layer's own causal / window rule), exactly what the
                     drafter sees at inference with ``a_j`` committed tokens
    loss   = Σ_{j, k>=1} w_k · CE(logits[j, k], ids[a_j + k]) / Σ w_k,
             w_k = exp(-(k-1)/γ)  (earlier slots matter more: a later slot counts only if
             every earlier one was accepted)

A DFlash2 drafter (``specs/dflash2.md``) adds the candidate selector's term, with the same
weights: at slot ``k`` its candidates are the ``selector_top_k`` best tokens of the slot's
logits (chosen without gradient; the label replaces the last when it is not among them),
scored with the TRUE previous token ``ids[a_j + k - 1]`` as predecessor (teacher forcing)::

    loss  += Σ_{j, k>=1} w_k · CE(selector_scores[j, k], label's candidate) / Σ w_k

and its logits term is on the unary scores (the logits scaled by ``output_multiplier``,
then soft-capped), the distribution its candidates come from.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from dflash.model.drafters import DFlash2Drafter, DFlashDrafter
from dflash.model.drafters.dflash2_ops import unary_scores

# γ by block size, from the DFlash paper's recipe (7 for B=16, 5 for B=10, 4 for B=8)
_GAMMA_BY_BLOCK = {8: 4.0, 10: 5.0, 16: 7.0}


def default_gamma(block_size: int) -> float:
    """The paper's γ for ``block_size`` (8, 10, 16); other sizes scale γ=7 by ``B/16``."""
    return _GAMMA_BY_BLOCK.get(block_size, max(1.0, 7.0 * block_size / 16))


def slot_weights(block_size: int, gamma: float, device: torch.device) -> Tensor:
    """[B]: 0 for the anchor slot, ``exp(-(k-1)/γ)`` for slots ``k >= 1``."""
    k = torch.arange(block_size, device=device, dtype=torch.float32)
    w = torch.exp(-(k - 1).clamp(min=0) / gamma)
    w[0] = 0.0
    return w


def sample_anchors(
    lo: int, seq_len: int, block_size: int, count: int, batch: int, gen: torch.Generator
) -> Tensor:
    """[batch, A] sorted distinct anchors drawn uniformly from ``[lo, seq_len - B]``.

    ``A = min(count, number of candidates)``; every label ``a + k`` (k < B) is in range.
    """
    hi = seq_len - block_size
    if hi < lo:
        raise ValueError(
            f"no anchor fits: sequences of {seq_len} tokens with the first anchor at {lo} "
            f"leave no room for a block of {block_size} (need seq_len >= {lo + block_size})"
        )
    candidates = hi - lo + 1
    a = min(count, candidates)
    scores = torch.rand(batch, candidates, generator=gen)
    picked = scores.argsort(dim=1)[:, :a] + lo
    return picked.sort(dim=1).values


@dataclass(frozen=True)
class BlockLoss:
    loss: Tensor  # scalar, differentiable
    accuracy: float  # share of (weighted-in) slots whose argmax is the label
    tokens: int  # labelled slots in the batch


def block_forward(
    drafter: DFlashDrafter,
    ids: Tensor,
    features: Tensor,
    anchors: Tensor,
    *,
    dense: bool = False,
) -> Tensor:
    """Final hidden states of every anchored block: [N, A*B, H].

    ids: [N, S] long; features: [N, S, F] (the frozen target's taps); anchors: [N, A].
    Each block attends over the context and itself only (:meth:`DFlashDrafter.run_blocks`,
    ``C + B`` scores per query); ``dense=True`` computes the same function as one
    attention over [context ; every block] with the other blocks masked out (``C + A*B``
    scores per query: the reference the blocked form is tested and timed against).
    """
    if dense and isinstance(drafter, DFlash2Drafter):
        raise ValueError("a DFlash2 drafter's blocks run blocked only (its convolutions run "
                         "inside each block): dense=False")
    n, s = ids.shape
    b = drafter.config.block_size
    device = drafter.device
    ids, anchors = ids.to(device), anchors.to(device)
    a = anchors.shape[1]
    ctx = drafter.project_context(features)  # [N, S, H]
    ctx_pos = torch.arange(s, device=device).expand(n, s)  # [N, S]
    kv = drafter.context_kv(ctx, ctx_pos)
    offsets = torch.arange(b, device=device)
    q_pos = (anchors[:, :, None] + offsets).reshape(n, a * b)  # [N, A*B]
    block = torch.full((n, a, b), drafter.config.mask_token_id, dtype=torch.long, device=device)
    block[:, :, 0] = torch.gather(ids, 1, anchors)  # the anchor token is given
    x = drafter.embed(block.reshape(n, a * b))  # [N, A*B, H]
    anchor_of_q = anchors.repeat_interleave(b, dim=1)  # [N, A*B]
    sees_ctx = ctx_pos[:, None, :] < anchor_of_q[:, :, None]  # [N, A*B, S]
    if not dense:
        return drafter.run_blocks(x, q_pos, kv, ctx_pos, sees_ctx, b)  # each block sees itself
    block_of = torch.arange(a * b, device=device) // b
    same_block = (block_of[:, None] == block_of[None, :]).expand(n, -1, -1)  # [N, A*B, A*B]
    visible = torch.cat([sees_ctx, same_block], dim=2)  # [N, A*B, S + A*B]
    return drafter.run_block(x, q_pos, kv, ctx_pos, visible)


def block_loss(
    drafter: DFlashDrafter,
    ids: Tensor,
    features: Tensor,
    anchors: Tensor,
    gamma: float,
    *,
    dense: bool = False,
) -> BlockLoss:
    """The position-weighted cross-entropy of :func:`block_forward`'s blocks (module doc)."""
    n, _ = ids.shape
    b = drafter.config.block_size
    hidden = block_forward(drafter, ids, features, anchors, dense=dense)  # [N, A*B, H]
    device = hidden.device
    logits = drafter.logits(hidden).float()  # [N, A*B, V]
    q_pos = (anchors.to(device)[:, :, None] + torch.arange(b, device=device)).reshape(n, -1)
    labels = torch.gather(ids.to(device), 1, q_pos)  # [N, A*B]: token at a + k
    w = slot_weights(b, gamma, device).repeat(anchors.shape[1])[None].expand(n, -1)
    raw = logits
    if isinstance(drafter, DFlash2Drafter):  # its distribution: the unary scores
        cfg = drafter.config
        logits = unary_scores(raw, cfg.output_multiplier, cfg.final_logit_softcapping)
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="none")
    loss = (ce * w.reshape(-1)).sum() / w.sum()
    picked = logits.argmax(-1)
    if isinstance(drafter, DFlash2Drafter):
        sel_ce, picked = _selector_term(drafter, hidden, raw, ids.to(device), q_pos, labels)
        loss = loss + (sel_ce * w).sum() / w.sum()
    with torch.no_grad():
        counted = w > 0
        right = (picked == labels) & counted
        accuracy = float(right.sum()) / max(1, int(counted.sum()))
    return BlockLoss(loss, accuracy, int(counted.sum()))


def _selector_term(
    drafter: DFlash2Drafter, hidden: Tensor, logits: Tensor, ids: Tensor, q_pos: Tensor,
    labels: Tensor,
) -> tuple[Tensor, Tensor]:
    """Per slot: the selector's cross-entropy on the label among its candidates, with the
    true predecessor (module docstring), and its teacher-forced pick ``[N, A*B]``;
    ``logits`` raw (the LM head's). The anchor slots (weight 0) get their own token as
    predecessor, a placeholder."""
    k = drafter.config.selector_top_k
    with torch.no_grad():
        cands = logits.topk(k, dim=-1).indices                          # [N, A*B, K]
        inside = (cands == labels[..., None]).any(-1)
        cands[..., -1] = torch.where(inside, cands[..., -1], labels)    # the label is in
        target = (cands == labels[..., None]).float().argmax(-1)        # its candidate index
    previous = torch.gather(ids, 1, (q_pos - 1).clamp(min=0))         # token at a + k - 1
    scores = drafter.selector_scores(hidden, logits, previous, cands)   # [N, A*B, K]
    ce = F.cross_entropy(scores.reshape(-1, k), target.reshape(-1), reduction="none")
    picked = cands.gather(-1, scores.argmax(-1, keepdim=True))[..., 0]
    return ce.reshape(labels.shape), picked
