"""The DFlash block drafter (z-lab's ``DFlashDraftModel`` semantics), with a context cache.

One proposal, with ``n = len(context)`` committed tokens and ``last`` pending at ``n``::

    ctx_i = hidden_norm(fc(features_i))           # every committed token i < n, [H]
    K_ctx, V_ctx (per layer) = k_norm(k_proj(ctx)) rotated at i, v_proj(ctx)   # cached
    x = embed([last, mask × (B-1)])               # the target's embedding, positions n … n+B-1
    per layer: queries of the block attend to [K_ctx ; K_block] (no mask in full-attention
               layers; causal and windowed in sliding-window layers), then the MLP
    guesses = argmax(lm_head(norm(x))[1:])        # the target's LM head, B-1 tokens

The drafter is in three parts: this module's :class:`DFlashDrafter` holds the weights,
their construction and checkpoint I/O and the forward pieces shared with training;
drafting on the host (the context cache and its proposals) is
:class:`dflash_host.HostDrafting` (``drafter.host``) and drafting on the device (a
static-capacity cache a CUDA graph can hold) is :class:`dflash_device.DeviceDrafting`
(``drafter.on_device``). The drafter's public drafting methods delegate to them.

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

from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dflash.model.drafters.dflash_checkpoint import (
    expected_shapes,
    read_config,
    read_weights,
    write_checkpoint,
)
from dflash.model.drafters.dflash_config import DFlash2Config, DFlashConfig
from dflash.model.drafters.dflash_device import DeviceDrafting
from dflash.model.drafters.dflash_host import HostDrafting
from dflash.model.drafters.dflash_layers import (
    BlockedVisibility,
    DrafterLayer,
    ProductLinear,
    RMSNorm,
    Rotary,
    product_dtype,
    visibility,
)
from dflash.model.drafters.dflash_products import DRAFT_DTYPES as DRAFT_DTYPES
from dflash.model.drafters.dflash_products import ContextKV as ContextKV
from dflash.model.drafters.dflash_products import check_draft_dtype as check_draft_dtype
from dflash.model.drafters.errors import (
    DraftArgumentError,
    TapLayerRangeError,
    TargetMismatchError,
    TargetShapeMismatchError,
)
from dflash.sampling import SamplingParams

_O_PROJ_GAIN = 4.0  # see DFlashDrafter.random


class DFlashDrafter(nn.Module):
    """DFlash block drafter sharing the target's embedding and LM head (see module doc)."""

    label = "dflash"
    #: the class of each layer (a DFlash2 drafter's wrap their sublayers in convolutions)
    layer_class: type[DrafterLayer] = DrafterLayer
    #: the config class this drafter reads (a subclass with its own registers itself)
    config_class: type[DFlashConfig] = DFlashConfig
    _formats: dict[type[DFlashConfig], type[DFlashDrafter]] = {}  # noqa: RUF012  # the class registry, written by __init_subclass__ only
    #: host proposals on CPU run the layers' packed weights (:meth:`DrafterLayer.infer`)
    packs_layers = True
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
        if self.class_for(config) is not type(self):
            raise DraftArgumentError(
                f"a {type(config).__name__} builds a {self.class_for(config).__name__}, not a "
                f"{type(self).__name__} (DFlashDrafter.random / from_pretrained choose it)"
            )
        self._draft_dtype = check_draft_dtype(draft_dtype)
        check_target(config, embed_weight, lm_head_weight, None, "the target")
        self.config = config
        self.fc = ProductLinear(config.feature_size, config.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.layers = nn.ModuleList(
            self.layer_class(config) for _ in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = Rotary(config)
        # plain attributes, not submodules/parameters: shared with the target, never saved
        object.__setattr__(self, "_embed_weight", embed_weight)
        object.__setattr__(self, "_lm_head_weight", lm_head_weight)
        self.rows_projected = 0  # context rows the host path ran through fc (cost accounting)
        self._context_window: int | None = None
        #: (weight key, copy) of the LM head as ``[H, V]`` in the products' dtype (_head_in)
        self._head_copy: tuple[tuple[int, int, torch.dtype], Tensor] | None = None
        self.host = HostDrafting(self)  # drafting on the host: the context cache (dflash_host)
        self.on_device = DeviceDrafting(self)  # drafting on the device (dflash_device)

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
        """Committed tokens whose context keys/values are cached (on the host)."""
        return self.host.cached_length

    @property
    def context_window(self) -> int | None:
        """The committed positions a block sees at most: the last ``W`` before it (None:
        all of them). A drafting option (``--draft-window``), not a checkpoint field: the
        block's queries never see a context key older than that, on the host and on the
        device, so a step costs the same at any context length (on the device the context
        cache becomes a ring of :attr:`context_reach` + ``B`` rows). Only guesses come out
        of the drafter: the output stays lossless."""
        return self._context_window

    @context_window.setter
    def context_window(self, window: int | None) -> None:
        if window is not None and (isinstance(window, bool) or not isinstance(window, int)
                                   or window < 1):
            raise DraftArgumentError(f"'context_window' must be an int >= 1 or None "
                                     f"(got {window!r})")
        if window != self._context_window:
            self._context_window = window
            self.host.reset()  # a cache cropped for another window cannot serve this one
            self.on_device.forget()

    @property
    def context_reach(self) -> int | None:
        """How many committed positions before the block any layer of a block sees: the
        :attr:`context_window`, or when every layer is a sliding-window layer (z-lab's
        ``sliding_window``) ``window - 1`` of the widest (the block's first query at
        position ``n`` sees keys ``n - window + 1 …``); the smaller of the two. None:
        every committed position."""
        windows = [self.config.layer_window(i) for i in range(self.config.num_hidden_layers)]
        layer_reach = None if None in windows else max(w for w in windows if w) - 1
        reaches = [r for r in (self._context_window, layer_reach) if r is not None]
        return min(reaches) if reaches else None

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
        kind = cls.class_for(config)
        # shapes only (meta device: no init work, global RNG untouched), then real storage
        with torch.device("meta"):
            drafter = kind(config, embed_weight, lm_head_weight, draft_dtype=draft_dtype)
        drafter.to_empty(device=embed_weight.device)
        return drafter.to(dtype=dtype or embed_weight.dtype)

    def __init_subclass__(cls, **kwargs: object) -> None:
        """A subclass naming its own :attr:`config_class` becomes that config's drafter
        (:meth:`class_for`): this module never imports the formats built on it."""
        super().__init_subclass__(**kwargs)
        if cls.config_class is not DFlashConfig:
            DFlashDrafter._formats[cls.config_class] = cls

    @classmethod
    def class_for(cls, config: DFlashConfig) -> type[DFlashDrafter]:
        """The drafter class of ``config``: the registered subclass of its config's class
        (:class:`~dflash.model.drafters.dflash2_drafter.DFlash2Drafter` for a
        :class:`DFlash2Config`), else this one."""
        kind = DFlashDrafter._formats.get(type(config), cls)
        return cls if issubclass(cls, kind) else kind

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
        kind = cls.class_for(config)
        if kind is not cls:  # a DFlash2 config: its own initialisation
            return kind.random(config, embed_weight, lm_head_weight, seed, dtype=dtype,
                               draft_dtype=draft_dtype)
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

    # -- drafting (delegated to the host part, dflash_host, and the device part, dflash_device)

    def reset(self) -> None:
        """Forget the cached context (:meth:`HostDrafting.reset`)."""
        self.host.reset()

    def propose(
        self, context: list[int], last: int, block_size: int, features: Tensor | None
    ) -> list[int]:
        """Greedy block proposal over the host cache (:meth:`HostDrafting.propose`)."""
        return self.host.propose(context, last, block_size, features)

    def select(self, hidden: Tensor, logits: Tensor, last: int | Tensor, start: int | Tensor,
               sampling: SamplingParams) -> Tensor | None:
        """A drafter's own choice of guesses from the slots' final hidden states and
        logits (a DFlash2 drafter's candidate selector); None: each slot's argmax, or the
        target's rule when it samples (v1)."""
        return None

    def couple(self, sampling: SamplingParams) -> None:
        """Draw guesses by the target's sampling rule and noise (coupled drafting), on the
        host (:meth:`HostDrafting.propose`) and on the device (:meth:`DeviceDrafting.couple`);
        greedy guesses for :data:`dflash.sampling.GREEDY`."""
        self.host.sampling = sampling
        self.on_device.couple(sampling)

    def probabilities(self, tokens: Sequence[int]) -> list[float]:
        """The last proposal's probability of each of ``tokens``
        (:meth:`HostDrafting.probabilities`)."""
        return self.host.probabilities(tokens)

    def candidates(self, k: int) -> list[list[tuple[int, float]]]:
        """The last host proposal's ``k`` best tokens per guess slot with their
        log-probabilities (:meth:`HostDrafting.candidates`): what tree drafts grow from."""
        return self.host.candidates(k)

    def confidence(self) -> list[float] | None:
        """The last host proposal's probability of each guess
        (:meth:`HostDrafting.confidence`)."""
        return self.host.confidence()

    def propose_uncached(self, features: Tensor, last: int, block_size: int) -> list[int]:
        """The proposal from every committed token's features, without the cache
        (:meth:`HostDrafting.propose_uncached`)."""
        return self.host.propose_uncached(features, last, block_size)

    def uncached_hidden(self, features: Tensor, last: int, block_size: int) -> Tensor:
        """The block's final hidden states [B, H] without the cache
        (:meth:`HostDrafting.uncached_hidden`)."""
        return self.host.uncached_hidden(features, last, block_size)

    def start_device(
        self, features: Tensor, last: int, capacity: int, block_size: int, start: int = 0,
        skipped: int = 0,
    ) -> Tensor:
        """Begin drafting on the device after a prefill (:meth:`DeviceDrafting.start_device`)."""
        return self.on_device.start_device(features, last, capacity, block_size, start,
                                           skipped)

    def can_continue_device(self, committed: int, capacity: int, block_size: int) -> bool:
        """Whether a prefill can continue the device context
        (:meth:`DeviceDrafting.can_continue_device`)."""
        return self.on_device.can_continue_device(committed, capacity, block_size)

    def set_device_inputs(self, rows: Tensor, commit_n: Tensor, tokens: Tensor) -> None:
        """The next device step's inputs (:meth:`DeviceDrafting.set_device_inputs`)."""
        self.on_device.set_device_inputs(rows, commit_n, tokens)

    def device_step(self) -> Tensor:
        """One capture-safe drafting step on the device (:meth:`DeviceDrafting.device_step`)."""
        return self.on_device.device_step()

    def use_device_candidates(self, k: int) -> None:
        """Each device proposal also carries its ``k`` best tokens per slot
        (:meth:`DeviceDrafting.use_candidates`; 0: the guesses alone)."""
        self.on_device.use_candidates(k)

    @property
    def device_buffers_version(self) -> int:
        """Bumped whenever the device buffers are allocated anew (graphs of the old ones must
        be dropped: they hold their addresses)."""
        return self.on_device.device_buffers_version

    @device_buffers_version.setter
    def device_buffers_version(self, value: int) -> None:
        self.on_device.device_buffers_version = value

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
        # a DFlash2 config may leave the depth out: its taps alone were checked then
        declared = not isinstance(config, DFlash2Config) or config.declares_target_depth
        if declared and config.num_target_layers != num_target_layers:
            raise TargetShapeMismatchError(
                where, "num_target_layers", config.num_target_layers, num_target_layers
            )
