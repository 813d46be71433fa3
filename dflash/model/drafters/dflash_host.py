"""Drafting on the host: the DFlash drafter's context cache and its proposals.

The context keys/values are a cache: each ``propose`` receives the tap features of the
tokens committed since the previous call (all prompt rows after a prefill, then the
``commit_n`` rows of each step), crops the cache to the committed length that precedes
them (a shorter or different context, e.g. a new prompt, resets it) and appends only
the new rows. The block's own keys/values are never cached.

:class:`HostDrafting` holds that state for one :class:`DFlashDrafter` (its ``host``) and
runs the drafter's weights and forward pieces; the drafter's public drafting methods
delegate to it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from dflash.model.drafters.base import check_block_size, check_context, check_token
from dflash.model.drafters.dflash_layers import PackedLayer, normed, product_dtype
from dflash.model.drafters.dflash_products import (
    ContextKV,
    DrafterWeights,
    DraftingPart,
    candidate_lists,
    drafting,
    slot_candidates,
)
from dflash.model.drafters.errors import DraftArgumentError
from dflash.sampling import GREEDY, SamplingParams, sample_tokens


class HostDrafting(DraftingPart):
    """The host drafting state of a :class:`DFlashDrafter` (see the module docstring)."""

    def __init__(self, drafter: DrafterWeights) -> None:
        super().__init__(drafter)
        config = drafter.config
        #: every layer's block queries see every context and block key (no causal rule, no
        #: window): the case DrafterLayer.infer computes
        self._sees_every_key = all(
            not config.layer_causal(i) and config.layer_window(i) is None
            for i in range(config.num_hidden_layers)
        )
        self._cache: list[tuple[Tensor, Tensor]] = []  # per layer k, v [1, kv_heads, cap, D]
        self._tokens: list[int] = []  # the committed tokens whose K/V are cached
        self._confidence: list[float] | None = None  # the last host proposal's probabilities
        # the last host proposal's logits [B-1, V] (float32 or wider) with each row's max and
        # 1 / sum(exp(logit - max)): what probabilities() reads
        self._scores: tuple[Tensor, Tensor, Tensor] | None = None
        #: the rule the target draws its tokens by: guesses are drawn with the same noise
        #: (coupled drafting, :meth:`propose`); greedy by default
        self.sampling: SamplingParams = GREEDY

    @property
    def cached_length(self) -> int:
        """Committed tokens whose context keys/values are cached."""
        return len(self._tokens)

    def reset(self) -> None:
        """Forget the cached context (the next ``propose`` must bring every row)."""
        self._cache = []
        self._tokens = []
        self._confidence = None
        self._scores = None

    @drafting
    def propose(
        self, context: list[int], last: int, block_size: int, features: Tensor | None
    ) -> list[int]:
        """Block proposal: ``block_size - 1`` guesses, one forward pass — the argmax of
        each slot's logits, or, when the target samples (:attr:`sampling`), the same rule
        drawn with the target's noise at the guess's absolute position (``len(context) +
        i`` for guess slot ``i``, 1-based): coupled drafting, so a drafter whose
        distribution is the target's is always accepted.

        ``features`` are the tap rows of the last ``T`` tokens of ``context`` (those not
        yet given, or given again); the cache keeps the ``len(context) - T`` before them.
        """
        d = self.drafter
        check_block_size(block_size)
        check_token("last", last, d.config.vocab_size)
        tokens = check_context(context, check_tokens=False)
        features = d._check_features(features, len(tokens))
        self._confidence, self._scores = None, None
        with torch.no_grad():
            # the packed weights, checked against the parameters once a proposal
            packs = [layer.packed() for layer in d._layers()] if self._packed_inference else None
            self._extend(tokens, features, packs)
            hidden = self._draft_hidden(last, block_size, packs)  # [B, H]
            logits = self._host_logits(hidden[1:])  # [B-1, V]: the mask slots
            wide = logits.to(torch.promote_types(logits.dtype, torch.float32))
            top, picked = wide.max(dim=-1)  # [B-1]: argmax's guesses (its first maximum)
            # the softmax probability at the argmax: 1 / sum(exp(logit - top))
            inverse = torch.exp(wide - top[:, None]).sum(-1).reciprocal()
            probs = inverse
            # the drafter's own choice (a DFlash2 selector; guess slot 1 sits at len(tokens))
            chosen = d.select(hidden[1:], wide, last, len(tokens) + 1, self.sampling)
            if chosen is None and not self.sampling.greedy:  # coupled: the target's rule
                at = len(tokens) + torch.arange(1, block_size, device=wide.device)
                chosen = sample_tokens(wide, at, self.sampling)
            if chosen is not None:
                picked = chosen
                probs = torch.exp(wide.gather(1, picked[:, None])[:, 0] - top) * inverse
            # one device-to-host transfer for both (ids < 2^53 are exact in float64)
            read = torch.stack([picked.double(), probs.double()]).tolist()
        self._confidence = [float(c) for c in read[1]]
        self._scores = (wide, top, inverse)
        return [int(t) for t in read[0]]

    def probabilities(self, tokens: Sequence[int]) -> list[float]:
        """The softmax probability the last :meth:`propose` gave ``tokens[i]`` at guess
        slot ``i`` (one token per slot, ``block_size - 1`` of them); its own guesses get
        :meth:`confidence`'s values.

        Raises:
            DraftArgumentError: no host proposal since the last reset, or ``tokens`` is
                not one token id per guess slot.
        """
        if self._scores is None:
            raise DraftArgumentError(
                "probabilities() needs a host proposal first (none since the last reset)"
            )
        wide, top, inverse = self._scores
        slots, vocab = wide.shape
        if not isinstance(tokens, Sequence) or len(tokens) != slots:
            got = len(tokens) if isinstance(tokens, Sequence) else type(tokens).__name__
            raise DraftArgumentError(
                f"'tokens' must be {slots} token ids, one per guess slot (got {got})"
            )
        for i, tok in enumerate(tokens):
            check_token(f"tokens[{i}]", tok, vocab)
        index = torch.tensor(list(tokens), device=wide.device)[:, None]
        at = wide.gather(1, index)[:, 0]  # [B-1]
        probs = (torch.exp(at - top) * inverse).clamp(max=1.0)
        return [float(p) for p in probs.double().tolist()]

    def candidates(self, k: int) -> list[list[tuple[int, float]]]:
        """The last :meth:`propose`'s ``k`` most likely tokens at each guess slot with their
        log-probabilities (log-softmax of the slot's logits), best first — the
        per-position distributions a tree draft grows from (ties: the lower token id).

        Raises:
            DraftArgumentError: no host proposal since the last reset, or ``k`` not an
                int in ``1 … vocab``.
        """
        if self._scores is None:
            raise DraftArgumentError(
                "candidates() needs a host proposal first (none since the last reset)"
            )
        wide = self._scores[0]
        vocab = wide.shape[1]
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= vocab:
            raise DraftArgumentError(f"'k' must be an int in [1, {vocab}] (got {k!r})")
        ids, log_probs = slot_candidates(wide, k)  # equal log-probs: the lower id first
        return candidate_lists(ids.tolist(), log_probs.tolist())

    def confidence(self) -> list[float] | None:
        """The softmax probability of each guess of the last :meth:`propose` (None before
        one, after :meth:`reset`, and for proposals made on the device)."""
        return None if self._confidence is None else list(self._confidence)

    @drafting
    @torch.no_grad()
    def propose_uncached(self, features: Tensor, last: int, block_size: int) -> list[int]:
        """The same proposal computed from the features of *every* committed token at once,
        without reading or changing the cache (the reference the cache is tested against)."""
        d = self.drafter
        hidden = self.uncached_hidden(features, last, block_size)
        logits = d.logits(hidden[1:])
        wide = logits.to(torch.promote_types(logits.dtype, torch.float32))
        chosen = d.select(hidden[1:], wide, last, features.shape[0] + 1, self.sampling)
        picked = wide.argmax(-1) if chosen is None else chosen
        return [int(t) for t in picked.tolist()]

    @drafting
    @torch.no_grad()
    def uncached_hidden(self, features: Tensor, last: int, block_size: int) -> Tensor:
        """Final hidden states [B, H] of the block after ``features`` [n, F] (no cache)."""
        d = self.drafter
        n = features.shape[0]
        reach = d.context_reach
        lo = 0 if reach is None else max(0, n - reach)  # as the cached path sees them
        ctx = d.project_context(features[None, lo:])  # [1, n - lo, H]
        ctx_pos = torch.arange(lo, n, device=d.device)[None]
        kv = d.context_kv(ctx, ctx_pos)
        x = d.embed(d.block_ids(last, block_size))
        q_pos = torch.arange(n, n + block_size, device=d.device)[None]
        return d.run_block(x, q_pos, kv, ctx_pos)[0]

    @drafting
    @torch.inference_mode()  # the cache is written in place: inference tensors allow it only here
    def _extend(
        self, tokens: list[int], features: Tensor, packs: list[PackedLayer] | None = None
    ) -> None:
        """Crop the cache to ``len(tokens) - T`` and append the ``T`` rows of ``features``
        (``packs``: the layers' packed weights, when the caller just took them)."""
        d = self.drafter
        n, t = len(tokens), features.shape[0]
        keep = n - t
        reach = d.context_reach
        if reach is not None and t >= reach and (
            keep > len(self._tokens) or self._tokens[:keep] != tokens[:keep]
        ):
            # the rows before ``keep`` lie outside every block's reach from here on: they
            # need no keys (a long prompt's prefill hands over only its last rows)
            self._write_rows(tokens, features, keep, packs, fresh=True)
            return
        if keep > len(self._tokens):
            raise DraftArgumentError(
                f"'features' has {t} rows for a context of {n} tokens, so the drafter needs "
                f"the first {keep} tokens cached, but it holds {len(self._tokens)}; pass the "
                f"features of every token committed since the previous call"
            )
        if self._tokens[:keep] != tokens[:keep]:
            first = next(i for i in range(keep) if self._tokens[i] != tokens[i])
            raise DraftArgumentError(
                f"'context' differs from the cached context at position {first} "
                f"(cached {self._tokens[first]}, got {tokens[first]}); pass the features of "
                f"every token from there on, or call reset()"
            )
        self._tokens = self._tokens[:keep]
        if t == 0:
            return
        self._write_rows(tokens, features, keep, packs, fresh=False)

    def _write_rows(
        self, tokens: list[int], features: Tensor, keep: int, packs: list[PackedLayer] | None,
        *, fresh: bool,
    ) -> None:
        """Keys/values of ``features`` at positions ``keep …`` into the cache; ``fresh``:
        the cached rows before ``keep`` are not kept (no block reads them)."""
        d = self.drafter
        n = len(tokens)
        ctx = d.project_context(features[None])  # [1, T, H]
        positions = torch.arange(keep, n, device=d.device)[None]
        if self._packed_inference:
            cos, sin = d.rotary.rolled(positions, ctx.dtype)
            layers = d._layers()
            weights = packs or [layer.packed() for layer in layers]
            new = [
                layer.context_keys_values(ctx[0], cos, sin, w)
                for layer, w in zip(layers, weights, strict=True)
            ]
        else:
            new = d.context_kv(ctx, positions)
        if not self._cache:
            self._cache = [(k.new_empty(0), v.new_empty(0)) for k, v in new]
        grown: list[tuple[Tensor, Tensor]] = []
        for (k_buf, v_buf), (k, v) in zip(self._cache, new, strict=True):
            if k_buf.dim() != 4 or k_buf.shape[2] < n:
                k_buf, v_buf = _grown(k_buf, v_buf, k, v, n, 0 if fresh else keep)
            k_buf[:, :, keep:n] = k
            v_buf[:, :, keep:n] = v
            grown.append((k_buf, v_buf))
        self._cache = grown
        self._tokens = tokens

    @property
    def _packed_inference(self) -> bool:
        """Host proposals run on :meth:`DrafterLayer.packed` weights: on CPU, where the
        packed copies make each projection one BLAS call (on a GPU the eager host path
        keeps the modules' weights, not a second copy of them in device memory)."""
        return self.drafter.device.type == "cpu" and self.drafter.packs_layers

    def _reserve(self, rows: int) -> None:
        """Grow the cache buffers to hold at least ``rows`` rows (the cached ones kept)."""
        keep = len(self._tokens)
        self._cache = [
            (k_buf, v_buf) if k_buf.shape[2] >= rows
            else _grown(k_buf, v_buf, k_buf, v_buf, rows, keep)
            for k_buf, v_buf in self._cache
        ]

    @drafting
    @torch.inference_mode()  # as _extend
    def _draft_hidden(
        self, last: int, block_size: int, packs: list[PackedLayer] | None = None
    ) -> Tensor:
        """[B, H] final hidden states of the block over the cached context.

        On CPU, when every key is visible, the layers run :meth:`DrafterLayer.infer` on
        their packed weights: the block's keys/values go into the cache rows after the
        context (scratch rows, overwritten by the next committed tokens) instead of
        concatenated copies; :meth:`DFlashDrafter.run_block` (what :meth:`uncached_hidden`
        runs, and the path elsewhere) is the reference it is tested against."""
        d = self.drafter
        n = len(self._tokens)
        x = d.embed(d.block_ids(last, block_size))  # [1, B, H]
        q_pos = torch.arange(n, n + block_size, device=d.device)[None]
        reach = d.context_reach
        lo = 0 if reach is None else max(0, n - reach)
        if self._cache and self._sees_every_key and not lo and self._packed_inference:
            cos, sin = d.rotary.rolled(q_pos, x.dtype)
            self._reserve(n + block_size)
            layers = d._layers()
            weights = packs or [layer.packed() for layer in layers]
            for layer, w, (k_buf, v_buf) in zip(layers, weights, self._cache, strict=True):
                x = layer.infer(x, k_buf, v_buf, n, cos, sin, w)
            out: Tensor = normed(x[0], d.norm.weight, d.norm.eps)
            return out
        # keys below n - reach are seen by no query of the block (a windowed layer's, or
        # the drafter's context window)
        kv: ContextKV = []
        for i in range(d.config.num_hidden_layers):
            if self._cache:
                k_buf, v_buf = self._cache[i]
                kv.append((k_buf[:, :, lo:n], v_buf[:, :, lo:n]))
            else:
                empty = x.new_empty(1, d.config.num_key_value_heads, 0, d.config.head_dim)
                kv.append((empty, empty))
        ctx_pos = torch.arange(lo, n, device=d.device)[None]
        return d.run_block(x, q_pos, kv, ctx_pos)[0]

    def _host_logits(self, hidden: Tensor) -> Tensor:
        """:meth:`DFlashDrafter.logits` of a host proposal of ``hidden [R, H]``: with the
        packed layers, the LM head's product too is an ``x @ W`` on the ``[H, V]`` copy of
        :meth:`DFlashDrafter._head_in`, which CPU BLAS runs faster than ``x @ weight.T``
        at these shapes."""
        d = self.drafter
        weight = d._lm_head_weight
        if not self._packed_inference:
            return d.logits(hidden)
        dtype = product_dtype(weight)
        return torch.mm(hidden.to(weight.device, dtype), d._head_in(dtype))


def _grown(
    k_buf: Tensor, v_buf: Tensor, k_like: Tensor, v_like: Tensor, rows: int, keep: int
) -> tuple[Tensor, Tensor]:
    """New cache buffers of at least ``rows`` rows (doubling, at least 64) holding the first
    ``keep`` rows of ``k_buf`` / ``v_buf``; shaped and typed like ``k_like`` / ``v_like``."""
    cap = max(rows, 2 * (k_buf.shape[2] if k_buf.dim() == 4 else 0), 64)
    k_new = k_like.new_empty(1, k_like.shape[1], cap, k_like.shape[3])
    v_new = v_like.new_empty(1, v_like.shape[1], cap, v_like.shape[3])
    if keep:
        k_new[:, :, :keep] = k_buf[:, :, :keep]
        v_new[:, :, :keep] = v_buf[:, :, :keep]
    return k_new, v_new
