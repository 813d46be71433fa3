"""The DFlash2 block drafter (``specs/dflash2.md``), drafting on the host.

DFlash2 is a DFlash drafter whose layers wrap each sublayer in a grouped dynamic
convolution over the block's rows (before it on the normalised input, after it on its
output, both sides' coefficients projected from the normalised input), and whose guesses
come from a candidate selector instead of each slot's argmax: the ``selector_top_k`` best
tokens of each slot's (scaled, soft-capped) logits, chosen left to right by their score
plus a bilinear term with the previous choice (:mod:`dflash.model.drafters.dflash2_ops`).
With the target sampling, the selector draws with the target's noise at each slot's
position (coupled drafting). The block embedding is scaled by ``input_embedding_scale``.

Context rows enter every layer's keys and values as in DFlash v1 (no convolution), so
the host context cache (:class:`dflash_host.HostDrafting`) serves DFlash2 unchanged; its
layers run :meth:`DFlash2Layer.forward` (the packed CPU fast path is v1's alone).

The device path (:class:`dflash_device.DeviceDrafting`) runs the same layers and the
selector's walk on tensors (no host read, so a CUDA graph holds the step): equal to the
host path on the CPU, also replayed from a recorded graph. (Drafts never change the
output: a device step that could not be captured would run eagerly, and one that drafted
differently would only be accepted less.) Tree drafts grow from the selector's dependent paths
(:meth:`DFlash2Drafter.selector_tree`; with prompt lookup's assistance its copy is the
tree's first branch), not from independent per-slot candidates. Training
(:mod:`dflash.training.objective`) convolves each anchored block on its own and trains
the selector on the true predecessor (:meth:`DFlash2Drafter.selector_scores`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dflash.model.drafters.dflash2_ops import (
    candidates,
    conv_deltas,
    dynamic_conv,
    selector_tree,
    selector_walk,
    unary_scores,
)
from dflash.model.drafters.dflash_config import DFlash2Config, DFlashConfig
from dflash.model.drafters.dflash_drafter import DFlashDrafter
from dflash.model.drafters.dflash_layers import BlockedVisibility, DrafterLayer, ProductLinear
from dflash.model.drafters.errors import DraftArgumentError, DrafterFormatNotBuiltError
from dflash.model.drafters.trees import DraftTree
from dflash.sampling import SamplingParams


class DynamicConv(nn.Module):
    """One sublayer's pair of grouped dynamic convolutions: ``base_kernel [2, Kc, H]``
    (side 0 before the sublayer, side 1 after it) and ``kernel_projection`` (``H`` →
    ``2 * Kc * H / G``, no bias)."""

    def __init__(self, cfg: DFlash2Config) -> None:
        super().__init__()
        self.kernel_size, self.groups = cfg.conv_kernel_size, cfg.conv_groups
        self.base_kernel = nn.Parameter(torch.empty(2, cfg.conv_kernel_size, cfg.hidden_size))
        self.kernel_projection = ProductLinear(
            cfg.hidden_size, 2 * cfg.conv_kernel_size * cfg.conv_groups, bias=False
        )

    def around(self, s: Tensor, sublayer: Any, *args: Any, block_size: int | None = None,
               ) -> Tensor:
        """``conv_1(sublayer(conv_0(s), *args))`` over the rows ``s [N, Q, H]``, both
        sides' deltas from ``s``: one block (``block_size`` None), or ``Q / block_size``
        blocks side by side (training), each convolved on its own."""
        n, q, h = s.shape
        per_block = (n, q // block_size, block_size, h) if block_size else s.shape

        def conv(z: Tensor, side: int, delta: Tensor) -> Tensor:
            out = dynamic_conv(z.reshape(per_block), self.base_kernel[side],
                               delta.reshape(*per_block[:-1], *delta.shape[-2:]).to(z.dtype))
            return out.reshape(n, q, h)

        delta = conv_deltas(s, self.kernel_projection.weight, self.kernel_size, self.groups)
        return conv(sublayer(conv(s, 0, delta[0]), *args), 1, delta[1])


class DFlash2Layer(DrafterLayer):
    """A DFlash layer with its attention and MLP each inside a :class:`DynamicConv`."""

    def __init__(self, cfg: DFlashConfig) -> None:
        if not isinstance(cfg, DFlash2Config):
            raise TypeError(f"a DFlash2 layer needs a DFlash2Config (got {type(cfg).__name__})")
        super().__init__(cfg)
        self.attention_conv = DynamicConv(cfg)
        self.mlp_conv = DynamicConv(cfg)

    def forward(self, x: Tensor, *attn_args: Any) -> Tensor:
        """``x: [N, Q, H]``: one block's rows, or (training, a :class:`BlockedVisibility`
        last in ``attn_args``) many blocks', the convolutions running inside each."""
        visible = attn_args[-1] if attn_args else None
        block = visible.block_size if isinstance(visible, BlockedVisibility) else None
        x = x + self.attention_conv.around(self.input_layernorm(x), self.self_attn, *attn_args,
                                           block_size=block)
        out: Tensor = x + self.mlp_conv.around(self.post_attention_layernorm(x), self.mlp,
                                               block_size=block)
        return out


class CandidateSelector(nn.Module):
    """``hidden_projection`` (``H`` → ``R``) and the two ``[V, R]`` codebooks (saved under
    bare names, as z-lab's checkpoints hold them)."""

    def __init__(self, cfg: DFlash2Config) -> None:
        super().__init__()
        self.hidden_projection = ProductLinear(cfg.hidden_size, cfg.selector_rank, bias=False)
        self.predecessor_codebook = nn.Parameter(torch.empty(cfg.vocab_size, cfg.selector_rank))
        self.successor_codebook = nn.Parameter(torch.empty(cfg.vocab_size, cfg.selector_rank))


class DFlash2Drafter(DFlashDrafter):
    """A DFlash2 drafter (module docstring); built by :meth:`DFlashDrafter.from_pretrained`
    for a DFlash2 checkpoint, or :meth:`random`."""

    label = "dflash2"
    config: DFlash2Config
    layer_class = DFlash2Layer
    config_class = DFlash2Config
    #: the host path runs the layers' :meth:`DFlash2Layer.forward`, not v1's packed form
    packs_layers = False

    def __init__(self, config: DFlashConfig, embed_weight: Tensor, lm_head_weight: Tensor,
                 *, draft_dtype: torch.dtype | None = None) -> None:
        if not isinstance(config, DFlash2Config):
            raise DraftArgumentError(
                f"a DFlash2 drafter needs a DFlash2Config (got {type(config).__name__})"
            )
        super().__init__(config, embed_weight, lm_head_weight, draft_dtype=draft_dtype)
        self.candidate_selector = CandidateSelector(config)
        #: the last host proposal's (scores, ids, projected hidden, anchor): its tree's stuff
        self._selection: tuple[Tensor, Tensor, Tensor, int] | None = None

    @classmethod
    def random(cls, config: DFlashConfig, embed_weight: Tensor, lm_head_weight: Tensor,
               seed: int, *, dtype: torch.dtype | None = None,
               draft_dtype: torch.dtype | None = None) -> DFlashDrafter:
        """:meth:`DFlashDrafter.random`, then each convolution an identity (tap 0 of both
        sides 1, the rest 0) plus small deltas (its projection scaled by 1/16), so an
        untrained DFlash2 drafter behaves like the v1 drafter of the same weights."""
        drafter = super().random(config, embed_weight, lm_head_weight, seed, dtype=dtype,
                                 draft_dtype=draft_dtype)
        with torch.no_grad():
            for layer in drafter.layers:
                assert isinstance(layer, DFlash2Layer)
                for conv in (layer.attention_conv, layer.mlp_conv):
                    conv.base_kernel.zero_()
                    conv.base_kernel[:, 0] = 1.0
                    conv.kernel_projection.weight.mul_(1 / 16)
        return drafter

    def embed(self, ids: Tensor) -> Tensor:
        """The target's embeddings scaled by ``input_embedding_scale``."""
        return super().embed(ids) * self.config.input_embedding_scale

    def select(self, hidden: Tensor, logits: Tensor, last: int | Tensor, start: int | Tensor,
               sampling: SamplingParams) -> Tensor:
        """The selector's guesses for the slots of ``hidden [B-1, H]`` (their final hidden
        states) with ``logits [B-1, V]``: ``last`` the anchor, ``start`` the first slot's
        absolute position (ints, or one-element tensors on the device: no host read);
        coupled to the target's noise unless ``sampling`` is greedy. Returns ``[B-1]``
        int64 on the logits' device."""
        cfg, sel = self.config, self.candidate_selector
        scores, ids = candidates(logits, cfg.selector_top_k, cfg.output_multiplier,
                                 cfg.final_logit_softcapping)
        e = F.linear(hidden.to(sel.hidden_projection.weight.dtype), sel.hidden_projection.weight)
        if isinstance(last, int):  # a host proposal: kept for selector_tree()
            self._selection = (scores, ids, e, last)
        return selector_walk(
            scores, ids, e, sel.predecessor_codebook, sel.successor_codebook, last,
            temperature=0.0 if sampling.greedy else sampling.temperature, seed=sampling.seed,
            start=start,
        )

    # -- not built yet --------------------------------------------------------------------

    def candidates(self, k: int) -> list[list[tuple[int, float]]]:
        raise DrafterFormatNotBuiltError(
            "a DFlash2 drafter's candidates depend on the previous slot's choice: its trees "
            "come from selector_tree(), not from independent per-slot candidates"
        )

    def use_device_candidates(self, k: int) -> None:
        if k:
            raise DrafterFormatNotBuiltError(
                "a DFlash2 drafter's candidates depend on the previous slot's choice: its "
                "trees come from selector_tree() on the host, not from device candidates"
            )

    def selector_tree(self, root: int, budget: int, *,
                      branch: Sequence[int] | None = None) -> DraftTree:
        """The draft tree of the last host proposal's selector paths
        (:func:`dflash2_ops.selector_tree`; ``root`` its anchor, the pending token)."""
        if self._selection is None:
            raise DraftArgumentError("selector_tree() needs a host proposal first")
        scores, ids, e, anchor = self._selection
        if root != anchor:
            raise DraftArgumentError(
                f"selector_tree() root {root} is not the last proposal's anchor {anchor}"
            )
        sel = self.candidate_selector
        return selector_tree(root, scores, ids, e, sel.predecessor_codebook,
                             sel.successor_codebook, budget, branch=branch)

    def selector_scores(self, hidden: Tensor, logits: Tensor, previous: Tensor,
                        candidates_ids: Tensor) -> Tensor:
        """Training's selector scores: ``hidden [..., H]`` and ``logits [..., V]`` of some
        slots, each slot's true predecessor token ``previous [...]`` and candidate tokens
        ``candidates_ids [..., K]`` → ``[..., K]`` float32: the candidates' unary scores
        plus the bilinear term with the predecessor (teacher forcing)."""
        cfg, sel = self.config, self.candidate_selector
        unary = unary_scores(logits.gather(-1, candidates_ids), cfg.output_multiplier,
                             cfg.final_logit_softcapping)
        e: Tensor = sel.hidden_projection(hidden).float()                 # [..., R]
        a = sel.predecessor_codebook[previous].float()                    # [..., R]
        s_rows = F.embedding(candidates_ids, sel.successor_codebook)      # [..., K, R]
        # one batched product in float32 (autocast off): no [..., K, R] product tensor,
        # forward or backward
        with torch.autocast(device_type=e.device.type, enabled=False):
            pair = torch.einsum("...kr,...r->...k", s_rows.float(), a * e)
        return unary + pair


__all__ = ["CandidateSelector", "DFlash2Drafter", "DFlash2Layer", "DynamicConv"]
