"""The DFlash block drafter (z-lab's ``DFlashDraftModel`` semantics), with a context cache.

One proposal, with ``n = len(context)`` committed tokens and ``last`` pending at ``n``::

    ctx_i = hidden_norm(fc(features_i))           # every committed token i < n, [H]
    K_ctx, V_ctx (per layer) = k_norm(k_proj(ctx)) rotated at i, v_proj(ctx)   # cached
    x = embed([last, mask × (B-1)])               # the target's embedding, positions n … n+B-1
    per layer: queries of the block attend to [K_ctx ; K_block] (no mask in full-attention
               layers; causal and windowed in sliding-window layers), then the MLP
    guesses = argmax(lm_head(norm(x))[1:])        # the target's LM head, B-1 tokens

The context keys/values are a cache: each ``propose`` receives the tap features of the
tokens committed since the previous call (all prompt rows after a prefill, then the
``commit_n`` rows of each step), crops the cache to the committed length that precedes
them (a shorter or different context, e.g. a new prompt, resets it) and appends only
the new rows. The block's own keys/values are never cached.

Drafting on the device (``start_device`` / ``set_device_inputs`` / ``device_step``): the
same maths over a static-capacity context cache, for a step whose accepted count is still
on the device. The cache holds ``capacity`` positions per layer; a step projects a fixed
``B`` rows (the verify's tap rows, of which the first ``commit_n`` are committed), writes
their keys/values at the drafter's device position, advances it by ``commit_n`` and runs
the block over every cached position with the uncommitted ones masked out. No host value
and no shape depends on the step, so a CUDA graph can hold it. Rows past ``commit_n``
land at positions the next step overwrites before they become visible.

The token embedding and LM head are the target's tensors, held by reference: they are not
parameters of the drafter and are not saved with it.

Product dtype (``draft_dtype``): the drafter multiplies in its weights' dtype (the LM head
in the head's) unless it is built with a ``draft_dtype``; then every drafting product —
``fc``, the projections, the MLP and the LM head, on the host and on the device alike —
multiplies in that dtype (on copies of the weights in it), while norms, attention and the
residual sums stay in the drafter's dtype. Only guesses come out of the drafter and the
target verifies every one, so any ``draft_dtype`` leaves the output lossless: it changes
which guesses are made, and so the speed, never the tokens. Training (``run_blocks``,
:meth:`logits` outside the drafting methods) multiplies the weights as they are.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Concatenate, ParamSpec, TypeVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dflash.model.drafters.base import check_block_size, check_context, check_token
from dflash.model.drafters.dflash_checkpoint import (
    expected_shapes,
    read_config,
    read_weights,
    write_checkpoint,
)
from dflash.model.drafters.dflash_config import DFlashConfig
from dflash.model.drafters.dflash_layers import (
    BlockedVisibility,
    DrafterLayer,
    PackedLayer,
    ProductLinear,
    RMSNorm,
    Rotary,
    normed,
    product_dtype,
    products_in,
    visibility,
)
from dflash.model.drafters.errors import (
    DraftArgumentError,
    TapLayerRangeError,
    TargetMismatchError,
    TargetShapeMismatchError,
)

_O_PROJ_GAIN = 4.0  # see DFlashDrafter.random
ContextKV = list[tuple[Tensor, Tensor]]  # per layer: k, v [N, kv_heads, C, D]
#: the dtypes a drafter's products may run in (``draft_dtype``)
DRAFT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

_P = ParamSpec("_P")
_R = TypeVar("_R")


def check_draft_dtype(draft_dtype: object) -> torch.dtype | None:
    """``draft_dtype`` itself when it is None or one of :data:`DRAFT_DTYPES`.

    Raises:
        DraftArgumentError: anything else (named in the message).
    """
    if draft_dtype is None:
        return None
    if isinstance(draft_dtype, torch.dtype) and draft_dtype in DRAFT_DTYPES:
        return draft_dtype
    allowed = ", ".join(str(d) for d in DRAFT_DTYPES)
    raise DraftArgumentError(
        f"'draft_dtype' must be None (the drafter's own dtype) or one of {allowed} "
        f"(got {draft_dtype!r})"
    )


def _drafting(
    method: Callable[Concatenate[DFlashDrafter, _P], _R],
) -> Callable[Concatenate[DFlashDrafter, _P], _R]:
    """Run a drafting method with its products in the drafter's ``draft_dtype``."""

    def run(self: DFlashDrafter, /, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        with products_in(self.draft_dtype):
            return method(self, *args, **kwargs)

    functools.update_wrapper(run, method)  # the method's name and docstring
    return run


class _DeviceCache:
    """Static buffers of drafting on the device (see the module docstring)."""

    def __init__(self, drafter: DFlashDrafter, capacity: int, block_size: int) -> None:
        cfg, dev, dt = drafter.config, drafter.device, drafter.dtype
        self.capacity, self.block_size, self.dtype, self.device = capacity, block_size, dt, dev
        shape = (1, cfg.num_key_value_heads, capacity, cfg.head_dim)
        # zeros: masked keys/values must be finite (0 · NaN would poison the attention)
        self.kv = [
            (torch.zeros(shape, dtype=dt, device=dev), torch.zeros(shape, dtype=dt, device=dev))
            for _ in range(cfg.num_hidden_layers)
        ]
        self.position = torch.zeros(1, dtype=torch.int64, device=dev)  # committed tokens
        self.rows = torch.zeros(block_size, cfg.feature_size, dtype=dt, device=dev)
        self.count = torch.ones(1, dtype=torch.int64, device=dev)
        self.tokens = torch.zeros(block_size, dtype=torch.int64, device=dev)
        self.masks = torch.full((1, block_size), cfg.mask_token_id, dtype=torch.long, device=dev)
        self.key_index = torch.arange(capacity, device=dev)  # [C]
        self.block_index = torch.arange(block_size, device=dev)  # [B]
        self.block_visible = torch.ones(block_size, dtype=torch.bool, device=dev)

    def fits(self, drafter: DFlashDrafter, capacity: int, block_size: int) -> bool:
        return (
            self.capacity >= capacity and self.block_size == block_size
            and self.dtype == drafter.dtype and self.device == drafter.device
        )


class DFlashDrafter(nn.Module):
    """DFlash block drafter sharing the target's embedding and LM head (see module doc)."""

    label = "dflash"
    _embed_weight: Tensor  # [V, H], the target's, by reference
    _lm_head_weight: Tensor  # [V, H], the target's, by reference

    def __init__(
        self,
        config: DFlashConfig,
        embed_weight: Tensor,
        lm_head_weight: Tensor,
        *,
        draft_dtype: torch.dtype | None = None,
    ) -> None:
        """Build with parameters left to ``torch.nn`` defaults; prefer :meth:`random` or
        :meth:`from_pretrained`, which set every parameter deterministically.
        ``draft_dtype``: the dtype the drafting products run in (module docstring; None:
        the weights' own)."""
        super().__init__()
        self._draft_dtype = check_draft_dtype(draft_dtype)
        check_target(config, embed_weight, lm_head_weight, None, "the target")
        self.config = config
        self.fc = ProductLinear(config.feature_size, config.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.layers = nn.ModuleList(DrafterLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = Rotary(config)
        #: every layer's block queries see every context and block key (no causal rule, no
        #: window): the case DrafterLayer.infer computes
        self._sees_every_key = all(
            not config.layer_causal(i) and config.layer_window(i) is None
            for i in range(config.num_hidden_layers)
        )
        # plain attributes, not submodules/parameters: shared with the target, never saved
        object.__setattr__(self, "_embed_weight", embed_weight)
        object.__setattr__(self, "_lm_head_weight", lm_head_weight)
        self._cache: list[tuple[Tensor, Tensor]] = []  # per layer k, v [1, kv_heads, cap, D]
        self._tokens: list[int] = []  # the committed tokens whose K/V are cached
        self._confidence: list[float] | None = None  # the last host proposal's probabilities
        # the last host proposal's logits [B-1, V] (float32 or wider) with each row's max and
        # 1 / sum(exp(logit - max)): what probabilities() reads
        self._scores: tuple[Tensor, Tensor, Tensor] | None = None
        self.rows_projected = 0  # context rows the host path ran through fc (cost accounting)
        #: (weight key, copy) of the LM head as ``[H, V]`` in the products' dtype (_head_in)
        self._head_copy: tuple[tuple[int, int, torch.dtype], Tensor] | None = None
        self._device: _DeviceCache | None = None
        #: bumped whenever the device buffers are allocated anew (graphs of the old ones
        #: must be dropped: they hold their addresses)
        self.device_buffers_version = 0

    @property
    def tap_layers(self) -> tuple[int, ...]:
        return self.config.target_layer_ids

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    @property
    def draft_dtype(self) -> torch.dtype | None:
        """The dtype the drafting products run in (None: each weight's own dtype)."""
        return self._draft_dtype

    @property
    def device(self) -> torch.device:
        return self.fc.weight.device

    @property
    def cached_length(self) -> int:
        """Committed tokens whose context keys/values are cached."""
        return len(self._tokens)

    # -- construction -------------------------------------------------------------------

    @classmethod
    def _empty(
        cls,
        config: DFlashConfig,
        embed_weight: Tensor,
        lm_head_weight: Tensor,
        dtype: torch.dtype | None,
        draft_dtype: torch.dtype | None,
    ) -> DFlashDrafter:
        # shapes only (meta device: no init work, global RNG untouched), then real storage
        with torch.device("meta"):
            drafter = cls(config, embed_weight, lm_head_weight, draft_dtype=draft_dtype)
        drafter.to_empty(device=embed_weight.device)
        return drafter.to(dtype=dtype or embed_weight.dtype)

    @classmethod
    def random(
        cls,
        config: DFlashConfig,
        embed_weight: Tensor,
        lm_head_weight: Tensor,
        seed: int,
        *,
        dtype: torch.dtype | None = None,
        draft_dtype: torch.dtype | None = None,
    ) -> DFlashDrafter:
        """Seeded random weights, drawn on the CPU in float32 in parameter-name order, so the
        same seed gives the same drafter on any device; ``dtype`` defaults to the embedding's;
        ``draft_dtype``: the products' dtype (module docstring; None: the weights').

        Norms are 1, biases 0 and linear weights N(0, 1/fan_in), except the attention output
        projections, N(0, 16/fan_in): with unit-scale target embeddings the untrained drafter
        would otherwise repeat whatever the mask embedding maps to, whereas this way the
        attended context drives its output, as it does in a trained drafter.
        """
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise DraftArgumentError(f"'seed' must be an int >= 0 (got {seed!r})")
        check_draft_dtype(draft_dtype)
        drafter = cls._empty(config, embed_weight, lm_head_weight, dtype, draft_dtype)
        gen = torch.Generator(device="cpu").manual_seed(seed)
        with torch.no_grad():
            for name, param in sorted(drafter.named_parameters()):
                if name.endswith("norm.weight"):
                    value = torch.ones(param.shape)
                elif name.endswith(".bias"):
                    value = torch.zeros(param.shape)
                else:
                    gain = _O_PROJ_GAIN if name.endswith("o_proj.weight") else 1.0
                    value = torch.randn(param.shape, generator=gen) * gain * param.shape[-1] ** -0.5
                param.copy_(value)
        return drafter.eval().requires_grad_(False)

    @classmethod
    def from_pretrained(
        cls,
        directory: str | Path,
        embed_weight: Tensor,
        lm_head_weight: Tensor,
        *,
        num_target_layers: int | None = None,
        dtype: torch.dtype | None = None,
        draft_dtype: torch.dtype | None = None,
    ) -> DFlashDrafter:
        """Load a z-lab-format drafter; typed errors on any problem, nothing half-loaded.

        ``num_target_layers``: the target's layer count (checks the tap layers against it).
        ``draft_dtype``: the products' dtype (module docstring; None: the weights').
        """
        check_draft_dtype(draft_dtype)
        config = read_config(directory)
        check_target(config, embed_weight, lm_head_weight, num_target_layers, str(directory))
        tensors = read_weights(directory, expected_shapes(config))
        drafter = cls._empty(config, embed_weight, lm_head_weight, dtype, draft_dtype)
        with torch.no_grad():
            for name, param in drafter.state_dict().items():
                param.copy_(tensors[name])
        return drafter.eval().requires_grad_(False)

    def save_pretrained(self, directory: str | Path) -> None:
        """Write z-lab's ``config.json`` + ``model.safetensors`` (bf16, own weights only)."""
        write_checkpoint(directory, self.config, self.state_dict())

    # -- the forward pieces (shared with training) --------------------------------------

    def embed(self, ids: Tensor) -> Tensor:
        """ids: [...] → the target's embeddings [..., H] in the drafter's dtype/device."""
        embed = self._embed_weight
        return F.embedding(ids.to(embed.device), embed).to(self.device, self.dtype)

    def project_context(self, features: Tensor) -> Tensor:
        """features: [N, C, len(taps)*H] → ``hidden_norm(fc(features))`` [N, C, H]."""
        self.rows_projected += int(features.shape[0] * features.shape[1])
        out: Tensor = self.hidden_norm(self.fc(features.to(self.device, self.dtype)))
        return out

    def context_kv(self, context: Tensor, positions: Tensor) -> ContextKV:
        """context: [N, C, H] projected rows at positions [N, C] → per-layer k, v."""
        cos, sin = self.rotary(positions, context.dtype)
        return [layer.self_attn.keys_values(context, cos, sin) for layer in self._layers()]

    def run_block(
        self,
        x: Tensor,
        q_pos: Tensor,
        ctx_kv: ContextKV,
        k_ctx_pos: Tensor,
        extra_visible: Tensor | None = None,
    ) -> Tensor:
        """The drafter layers over block rows; returns ``norm(x)`` [N, Q, H].

        Args:
            x: [N, Q, H] embedded block rows at positions ``q_pos`` [N, Q].
            ctx_kv: per layer k, v [N, kv_heads, C, D] of context rows at ``k_ctx_pos`` [N, C].
            extra_visible: [N, Q, C+Q] bool ANDed into every layer's mask (the dense form
                of the training mask — each block sees only context before its anchor and
                its own block; training itself runs :meth:`run_blocks`), or None.
        """
        cos, sin = self.rotary(q_pos, x.dtype)
        k_pos = torch.cat([k_ctx_pos, q_pos], dim=1)  # [N, C+Q]
        for i, layer in enumerate(self._layers()):
            cfg = self.config
            visible = visibility(
                q_pos, k_pos, causal=cfg.layer_causal(i), window=cfg.layer_window(i)
            )
            if extra_visible is not None:
                visible = extra_visible if visible is None else visible & extra_visible
            k_ctx, v_ctx = ctx_kv[i]
            x = layer(x, k_ctx, v_ctx, cos, sin, visible)
        out: Tensor = self.norm(x)
        return out

    def run_blocks(
        self,
        x: Tensor,
        q_pos: Tensor,
        ctx_kv: ContextKV,
        k_ctx_pos: Tensor,
        sees_context: Tensor,
        block_size: int,
    ) -> Tensor:
        """The drafter layers over many anchored blocks at once (training); ``norm(x)``.

        :meth:`run_block` with the training mask — every block sees the context rows
        ``sees_context`` allows and its own rows, never another block — computed block by
        block (:func:`blocked_attention`: ``C + B`` scores per query, not ``C + Q``).

        Args:
            x: [N, Q, H] embedded rows of ``Q / block_size`` blocks at positions ``q_pos``.
            ctx_kv: per layer k, v [N, kv_heads, C, D] of context rows at ``k_ctx_pos``.
            sees_context: [N, Q, C] bool, ANDed with each layer's causal / window rule.
        """
        n, q_len = q_pos.shape
        if q_len % block_size:
            raise ValueError(f"{q_len} query rows are not whole blocks of {block_size}")
        cos, sin = self.rotary(q_pos, x.dtype)
        blocks = q_pos.reshape(n * (q_len // block_size), block_size)
        cfg = self.config
        for i, layer in enumerate(self._layers()):
            causal, window = cfg.layer_causal(i), cfg.layer_window(i)
            ctx_rule = visibility(q_pos, k_ctx_pos, causal=causal, window=window)
            blk_rule = visibility(blocks, blocks, causal=causal, window=window)
            visible = BlockedVisibility(
                sees_context if ctx_rule is None else ctx_rule & sees_context,
                None if blk_rule is None else blk_rule.reshape(n, -1, block_size, block_size),
                block_size,
            )
            k_ctx, v_ctx = ctx_kv[i]
            x = layer(x, k_ctx, v_ctx, cos, sin, visible)
        out: Tensor = self.norm(x)
        return out

    def logits(self, hidden: Tensor) -> Tensor:
        """``[..., V]`` logits through the target's LM head (on the LM head's device, which
        may differ from the embedding's when the target is split across devices), in
        :func:`product_dtype` (the head's own dtype outside a drafting method)."""
        weight = self._lm_head_weight
        dtype = product_dtype(weight)
        if dtype == weight.dtype:
            return F.linear(hidden.to(weight.device, dtype), weight)
        return torch.matmul(hidden.to(weight.device, dtype), self._head_in(dtype))

    def _host_logits(self, hidden: Tensor) -> Tensor:
        """:meth:`logits` of a host proposal of ``hidden [R, H]``: with the packed layers,
        the LM head's product too is an ``x @ W`` on the ``[H, V]`` copy of
        :meth:`_head_in`, which CPU BLAS runs faster than ``x @ weight.T`` at these
        shapes."""
        weight = self._lm_head_weight
        if not self._packed_inference:
            return self.logits(hidden)
        dtype = product_dtype(weight)
        return torch.mm(hidden.to(weight.device, dtype), self._head_in(dtype))

    def _head_in(self, dtype: torch.dtype) -> Tensor:
        """The LM head as a contiguous ``[H, V]`` matrix in ``dtype``, made again whenever
        the dtype differs or the weight was changed or replaced (its storage address or
        version counter moved)."""
        weight = self._lm_head_weight
        key = (weight.data_ptr(), -1 if weight.is_inference() else weight._version, dtype)
        if self._head_copy is None or self._head_copy[0] != key:
            with torch.no_grad():
                self._head_copy = (key, weight.detach().T.to(dtype).contiguous())
        return self._head_copy[1]

    def _layers(self) -> list[DrafterLayer]:
        return [layer for layer in self.layers if isinstance(layer, DrafterLayer)]

    def block_ids(self, last: int, block_size: int) -> Tensor:
        """``[last, mask × (B-1)]`` as a [1, B] long tensor."""
        block = torch.full((1, block_size), self.config.mask_token_id, dtype=torch.long)
        block[0, 0] = last
        return block

    # -- drafting -----------------------------------------------------------------------

    def reset(self) -> None:
        """Forget the cached context (the next ``propose`` must bring every row)."""
        self._cache = []
        self._tokens = []
        self._confidence = None
        self._scores = None

    @_drafting
    def propose(
        self, context: list[int], last: int, block_size: int, features: Tensor | None
    ) -> list[int]:
        """Greedy block proposal: ``block_size - 1`` argmax tokens, one forward pass.

        ``features`` are the tap rows of the last ``T`` tokens of ``context`` (those not
        yet given, or given again); the cache keeps the ``len(context) - T`` before them.
        """
        check_block_size(block_size)
        check_token("last", last, self.config.vocab_size)
        tokens = check_context(context, check_tokens=False)
        features = self._check_features(features, len(tokens))
        self._confidence, self._scores = None, None
        with torch.no_grad():
            # the packed weights, checked against the parameters once a proposal
            packs = [layer.packed() for layer in self._layers()] if self._packed_inference else None
            self._extend(tokens, features, packs)
            hidden = self._draft_hidden(last, block_size, packs)  # [B, H]
            logits = self._host_logits(hidden[1:])  # [B-1, V]: the mask slots
            wide = logits.to(torch.promote_types(logits.dtype, torch.float32))
            top, picked = wide.max(dim=-1)  # [B-1]: argmax's guesses (its first maximum)
            # the softmax probability at the guess: 1 / sum(exp(logit - top))
            probs = torch.exp(wide - top[:, None]).sum(-1).reciprocal()
            # one device-to-host transfer for both (ids < 2^53 are exact in float64)
            read = torch.stack([picked.double(), probs.double()]).tolist()
        self._confidence = [float(c) for c in read[1]]
        self._scores = (wide, top, probs)
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

    def confidence(self) -> list[float] | None:
        """The softmax probability of each guess of the last :meth:`propose` (None before
        one, after :meth:`reset`, and for proposals made on the device)."""
        return None if self._confidence is None else list(self._confidence)

    @_drafting
    @torch.no_grad()
    def propose_uncached(self, features: Tensor, last: int, block_size: int) -> list[int]:
        """The same proposal computed from the features of *every* committed token at once,
        without reading or changing the cache (the reference the cache is tested against)."""
        hidden = self.uncached_hidden(features, last, block_size)
        return [int(t) for t in self.logits(hidden[1:]).argmax(-1).tolist()]

    @_drafting
    @torch.no_grad()
    def uncached_hidden(self, features: Tensor, last: int, block_size: int) -> Tensor:
        """Final hidden states [B, H] of the block after ``features`` [n, F] (no cache)."""
        n = features.shape[0]
        ctx = self.project_context(features[None])  # [1, n, H]
        ctx_pos = torch.arange(n, device=self.device)[None]
        kv = self.context_kv(ctx, ctx_pos)
        x = self.embed(self.block_ids(last, block_size))
        q_pos = torch.arange(n, n + block_size, device=self.device)[None]
        return self.run_block(x, q_pos, kv, ctx_pos)[0]

    @_drafting
    @torch.inference_mode()  # the cache is written in place: inference tensors allow it only here
    def _extend(
        self, tokens: list[int], features: Tensor, packs: list[PackedLayer] | None = None
    ) -> None:
        """Crop the cache to ``len(tokens) - T`` and append the ``T`` rows of ``features``
        (``packs``: the layers' packed weights, when the caller just took them)."""
        n, t = len(tokens), features.shape[0]
        keep = n - t
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
        ctx = self.project_context(features[None])  # [1, T, H]
        positions = torch.arange(keep, n, device=self.device)[None]
        if self._packed_inference:
            cos, sin = self.rotary.rolled(positions, ctx.dtype)
            layers = self._layers()
            weights = packs or [layer.packed() for layer in layers]
            new = [
                layer.context_keys_values(ctx[0], cos, sin, w)
                for layer, w in zip(layers, weights, strict=True)
            ]
        else:
            new = self.context_kv(ctx, positions)
        if not self._cache:
            self._cache = [(k.new_empty(0), v.new_empty(0)) for k, v in new]
        grown: list[tuple[Tensor, Tensor]] = []
        for (k_buf, v_buf), (k, v) in zip(self._cache, new, strict=True):
            if k_buf.dim() != 4 or k_buf.shape[2] < n:
                k_buf, v_buf = _grown(k_buf, v_buf, k, v, n, keep)
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
        return self.device.type == "cpu"

    def _reserve(self, rows: int) -> None:
        """Grow the cache buffers to hold at least ``rows`` rows (the cached ones kept)."""
        keep = len(self._tokens)
        self._cache = [
            (k_buf, v_buf) if k_buf.shape[2] >= rows
            else _grown(k_buf, v_buf, k_buf, v_buf, rows, keep)
            for k_buf, v_buf in self._cache
        ]

    @_drafting
    @torch.inference_mode()  # as _extend
    def _draft_hidden(
        self, last: int, block_size: int, packs: list[PackedLayer] | None = None
    ) -> Tensor:
        """[B, H] final hidden states of the block over the cached context.

        On CPU, when every key is visible, the layers run :meth:`DrafterLayer.infer` on
        their packed weights: the block's keys/values go into the cache rows after the
        context (scratch rows, overwritten by the next committed tokens) instead of
        concatenated copies; :meth:`run_block` (what :meth:`uncached_hidden` runs, and
        the path elsewhere) is the reference it is tested against."""
        n = len(self._tokens)
        x = self.embed(self.block_ids(last, block_size))  # [1, B, H]
        q_pos = torch.arange(n, n + block_size, device=self.device)[None]
        if self._cache and self._sees_every_key and self._packed_inference:
            cos, sin = self.rotary.rolled(q_pos, x.dtype)
            self._reserve(n + block_size)
            layers = self._layers()
            weights = packs or [layer.packed() for layer in layers]
            for layer, w, (k_buf, v_buf) in zip(layers, weights, self._cache, strict=True):
                x = layer.infer(x, k_buf, v_buf, n, cos, sin, w)
            out: Tensor = normed(x[0], self.norm.weight, self.norm.eps)
            return out
        # a windowed layer's queries (positions >= n) see no key below n - window + 1
        windows = [self.config.layer_window(i) for i in range(self.config.num_hidden_layers)]
        lo = 0 if None in windows else max(0, n - max(w for w in windows if w) + 1)
        kv: ContextKV = []
        for i in range(self.config.num_hidden_layers):
            if self._cache:
                k_buf, v_buf = self._cache[i]
                kv.append((k_buf[:, :, lo:n], v_buf[:, :, lo:n]))
            else:
                empty = x.new_empty(1, self.config.num_key_value_heads, 0, self.config.head_dim)
                kv.append((empty, empty))
        ctx_pos = torch.arange(lo, n, device=self.device)[None]
        return self.run_block(x, q_pos, kv, ctx_pos)[0]

    # -- drafting on the device --------------------------------------------------------

    @_drafting
    @torch.no_grad()
    def start_device(
        self, features: Tensor, last: int, capacity: int, block_size: int
    ) -> Tensor:
        """Begin drafting on the device after a prefill of ``n = features.shape[0]`` tokens
        (their tap rows ``[n, F]``): fill the static cache (``capacity`` positions, at
        least ``n + block_size``) and return the first proposal after ``last``, ``[B-1]``
        int64 on the LM head's device (eager: ``n`` is the prompt's length)."""
        check_block_size(block_size)
        check_token("last", last, self.config.vocab_size)
        n = int(features.shape[0]) if isinstance(features, Tensor) else 0
        features = self._check_features(features, n)
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < n + block_size:
            raise DraftArgumentError(
                f"'capacity' must be an int >= {n + block_size} (the {n} prompt rows and a "
                f"block of {block_size}; got {capacity!r})"
            )
        dev = self._device
        if dev is None or not dev.fits(self, capacity, block_size):
            dev = self._device = _DeviceCache(self, capacity, block_size)
            self.device_buffers_version += 1
        dev.position.zero_()
        self._write_context(dev, features.to(self.device, self.dtype), None)
        last_t = torch.full((1,), last, dtype=torch.int64, device=self.device)
        return self._device_block(dev, last_t)

    def set_device_inputs(self, rows: Tensor, commit_n: Tensor, tokens: Tensor) -> None:
        """The inputs of the next :meth:`device_step`, copied into its static buffers:
        ``rows [T, F]`` the tap rows of the last verify (``T <= B``), ``commit_n [1]`` how
        many of them were committed, ``tokens [T]`` the target's tokens after each (the
        new pending token is ``tokens[commit_n-1]``)."""
        dev = self._require_device()
        t = int(rows.shape[0])
        width = self.config.feature_size
        if rows.dim() != 2 or rows.shape[1] != width or not 1 <= t <= dev.block_size:
            raise DraftArgumentError(
                f"'rows' must be [T, {width}] with 1 <= T <= "
                f"{dev.block_size} (got {list(rows.shape)})"
            )
        if tuple(tokens.shape) != (t,) or tuple(commit_n.shape) != (1,):
            raise DraftArgumentError(
                f"'tokens' must be [{t}] and 'commit_n' [1] (got {list(tokens.shape)}, "
                f"{list(commit_n.shape)})"
            )
        dev.rows[:t].copy_(rows)
        dev.tokens[:t].copy_(tokens)
        dev.count.copy_(commit_n)

    @_drafting
    @torch.no_grad()
    def device_step(self) -> Tensor:
        """One drafting step on the device (capture-safe: no host value, static shapes):
        the committed rows of :meth:`set_device_inputs` join the context and the block
        after the new pending token is drafted; returns ``[B-1]`` int64 guesses."""
        dev = self._require_device()
        self._write_context(dev, dev.rows, dev.count)
        last = dev.tokens.gather(0, dev.count - 1)  # [1]
        return self._device_block(dev, last)

    def _require_device(self) -> _DeviceCache:
        if self._device is None:
            raise DraftArgumentError("drafting on the device needs start_device() first")
        return self._device

    def _write_context(self, dev: _DeviceCache, rows: Tensor, count: Tensor | None) -> None:
        """Keys/values of ``rows [R, F]`` at positions ``position … position+R-1``;
        ``position += count`` (all ``R`` rows when ``count`` is None)."""
        r = rows.shape[0]
        ctx = self.hidden_norm(self.fc(rows))[None]  # [1, R, H]
        positions = dev.position + (dev.block_index if r == dev.block_size
                                    else torch.arange(r, device=self.device))  # [R]
        for (k_buf, v_buf), (k, v) in zip(dev.kv, self.context_kv(ctx, positions[None]),
                                          strict=True):
            k_buf.index_copy_(2, positions, k)
            v_buf.index_copy_(2, positions, v)
        if count is None:
            dev.position.add_(r)
        else:
            dev.position.add_(count)

    def _device_block(self, dev: _DeviceCache, last: Tensor) -> Tensor:
        """``[B-1]`` guesses after ``last [1]`` over the cached context (positions below
        ``position`` visible, the rest masked)."""
        ids = torch.cat([last.view(1, 1), dev.masks[:, 1:]], dim=1)  # [1, B]
        x = self.embed(ids)
        q_pos = (dev.position + dev.block_index)[None]  # [1, B]
        ctx_visible = dev.key_index < dev.position  # [C]
        visible = torch.cat([ctx_visible, dev.block_visible])[None, None]  # [1, 1, C+B]
        visible = visible.expand(1, dev.block_size, -1)
        hidden = self.run_block(x, q_pos, dev.kv, dev.key_index[None], visible)[0]  # [B, H]
        return self.logits(hidden[1:]).argmax(dim=-1)

    def _check_features(self, features: Tensor | None, n_context: int) -> Tensor:
        width = self.config.feature_size
        if features is None:
            raise DraftArgumentError(
                f"'features' is required by the DFlash drafter: [T, {width}] tap hidden states "
                f"of target_layer_ids {list(self.tap_layers)} (got None)"
            )
        if not isinstance(features, Tensor):
            raise DraftArgumentError(
                f"'features' must be a torch.Tensor (got {type(features).__name__})"
            )
        if features.dim() != 2 or features.shape[1] != width:
            raise DraftArgumentError(
                f"'features' must have shape [T, {width}] (got {list(features.shape)})"
            )
        if features.shape[0] > n_context:
            raise DraftArgumentError(
                f"'features' has {features.shape[0]} rows, more than the {n_context} "
                f"context tokens they describe"
            )
        if not features.is_floating_point():
            raise DraftArgumentError(f"'features' must be floating point (got {features.dtype})")
        return features


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


def check_target(
    config: DFlashConfig,
    embed_weight: object,
    lm_head_weight: object,
    num_target_layers: int | None,
    where: str,
) -> None:
    """The target's embedding / LM head / layer count must fit the drafter config."""
    for name, weight in (("embed_weight", embed_weight), ("lm_head_weight", lm_head_weight)):
        if not isinstance(weight, Tensor) or weight.dim() != 2:
            shown = list(weight.shape) if isinstance(weight, Tensor) else type(weight).__name__
            raise TargetMismatchError(
                f"{where}: {name!r} must be a [vocab_size, hidden_size] tensor (got {shown})"
            )
        if int(weight.shape[1]) != config.hidden_size:
            raise TargetShapeMismatchError(
                where, "hidden_size", config.hidden_size, int(weight.shape[1])
            )
        if int(weight.shape[0]) != config.vocab_size:
            raise TargetShapeMismatchError(
                where, "vocab_size", config.vocab_size, int(weight.shape[0])
            )
    if num_target_layers is not None:
        bad = [t for t in config.target_layer_ids if not 0 <= t < num_target_layers]
        if bad:
            raise TapLayerRangeError(
                f"{where}: target_layer_ids {list(config.target_layer_ids)} include {bad}, "
                f"outside the target's layers 0..{num_target_layers - 1}"
            )
        if config.num_target_layers != num_target_layers:
            raise TargetShapeMismatchError(
                where, "num_target_layers", config.num_target_layers, num_target_layers
            )
