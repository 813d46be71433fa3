"""Configuration of the DFlash block drafter, in z-lab's published ``config.json`` format.

A DFlash drafter's ``config.json`` is a Hugging Face Qwen3 configuration
(``model_type: "qwen3"``, ``architectures: ["DFlashDraftModel"]``) plus three DFlash
fields: ``block_size``, ``num_target_layers`` and
``dflash_config: {mask_token_id, target_layer_ids}``.  When ``target_layer_ids`` is absent
the taps default to z-lab's rule (:func:`default_tap_layers`).  Optional ``layer_types``
(``"full_attention"`` / ``"sliding_attention"``) with ``sliding_window`` make some layers
sliding-window layers; those attend causally (z-lab's default for them) unless
``is_causal`` says otherwise, full-attention layers attend without a mask.

The drafter has no embedding or LM head of its own: ``hidden_size`` and ``vocab_size`` are
the target's, and the target's tensors are used.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

ARCHITECTURE = "DFlashDraftModel"
#: z-lab's second format (``specs/dflash2.md``): v1 plus dynamic convolutions around each
#: sublayer, a candidate selector and three output scalars
ARCHITECTURE_V2 = "DFlash2DraftModel"
MODEL_TYPE = "qwen3"
LayerType = Literal["full_attention", "sliding_attention"]
ROPE_TYPES = ("default", "linear", "yarn")


class DFlashConfig(BaseModel):
    """Shapes and semantics of a DFlash drafter (field names are the ``config.json`` keys)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    hidden_size: int = Field(ge=1)
    vocab_size: int = Field(ge=2)
    num_hidden_layers: int = Field(ge=1)
    num_attention_heads: int = Field(ge=1)
    num_key_value_heads: int = Field(ge=1)
    head_dim: int = Field(ge=2)
    intermediate_size: int = Field(ge=1)
    rms_norm_eps: float = Field(default=1e-6, gt=0.0, lt=1.0)
    rope_theta: float = Field(default=1_000_000.0, gt=0.0)
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = Field(default=40960, ge=1)
    attention_bias: bool = False
    block_size: int = Field(default=16, ge=2)
    num_target_layers: int = Field(ge=1)
    mask_token_id: int = Field(ge=0)
    target_layer_ids: tuple[int, ...] = Field(min_length=1)
    layer_types: tuple[LayerType, ...] | None = None
    sliding_window: int | None = Field(default=None, ge=1)
    is_causal: bool | None = None
    """``None``: sliding-window layers causal, full-attention layers not (z-lab's rule)."""

    @model_validator(mode="after")
    def _check_consistency(self) -> DFlashConfig:
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(
                f"'num_attention_heads' ({self.num_attention_heads}) must be a multiple of "
                f"'num_key_value_heads' ({self.num_key_value_heads})"
            )
        if self.head_dim % 2 != 0:
            raise ValueError(f"'head_dim' must be even for rotary embedding (got {self.head_dim})")
        if self.mask_token_id >= self.vocab_size:
            raise ValueError(
                f"'mask_token_id' must be < vocab_size={self.vocab_size} (got {self.mask_token_id})"
            )
        for i, layer in enumerate(self.target_layer_ids):
            if not 0 <= layer < self.num_target_layers:
                raise ValueError(
                    f"'target_layer_ids'[{i}] must be in [0, num_target_layers="
                    f"{self.num_target_layers}) (got {layer})"
                )
        if len(set(self.target_layer_ids)) != len(self.target_layer_ids):
            raise ValueError(
                f"'target_layer_ids' must be distinct (got {list(self.target_layer_ids)})"
            )
        if self.layer_types is not None:
            if len(self.layer_types) != self.num_hidden_layers:
                raise ValueError(
                    f"'layer_types' must have num_hidden_layers={self.num_hidden_layers} "
                    f"entries (got {len(self.layer_types)})"
                )
            if "sliding_attention" in self.layer_types and self.sliding_window is None:
                raise ValueError("'sliding_window' is required by 'sliding_attention' layers")
        _check_rope_scaling(self.rope_scaling)
        return self

    # -- derived values -------------------------------------------------------------------

    @property
    def feature_size(self) -> int:
        """Width of a ``features`` row: ``len(target_layer_ids) * hidden_size``."""
        return len(self.target_layer_ids) * self.hidden_size

    def layer_type(self, layer: int) -> LayerType:
        return "full_attention" if self.layer_types is None else self.layer_types[layer]

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of ``layer`` (``None``: it sees every key)."""
        return self.sliding_window if self.layer_type(layer) == "sliding_attention" else None

    def layer_causal(self, layer: int) -> bool:
        """Whether ``layer``'s block queries see only keys at positions <= their own."""
        if self.is_causal is not None:
            return self.is_causal
        return self.layer_type(layer) == "sliding_attention"

    # -- construction ---------------------------------------------------------------------

    @classmethod
    def for_target(
        cls,
        *,
        hidden_size: int,
        vocab_size: int,
        num_target_layers: int,
        num_attention_heads: int | None = None,
        num_key_value_heads: int | None = None,
        head_dim: int | None = None,
        intermediate_size: int | None = None,
        num_hidden_layers: int = 1,
        block_size: int = 16,
        mask_token_id: int | None = None,
        target_layer_ids: tuple[int, ...] | None = None,
        rms_norm_eps: float = 1e-6,
        rope_theta: float = 1_000_000.0,
        max_position_embeddings: int = 40960,
    ) -> DFlashConfig:
        """A drafter shaped like the target's attention (as z-lab's drafters are).

        Heads default to a head_dim <= 128 dividing ``hidden_size`` with at least two
        heads, two KV heads where possible; taps default to :func:`default_tap_layers`;
        the mask token to ``vocab_size - 1``.
        """
        if head_dim is None or num_attention_heads is None:
            divisors = [d for d in (128, 64, 32, 16, 8, 4, 2) if hidden_size % d == 0]
            head_dim = next((d for d in divisors if hidden_size // d >= 2), 2)
            num_attention_heads = max(1, hidden_size // head_dim)
        if num_key_value_heads is None:
            num_key_value_heads = next(k for k in (2, 1) if num_attention_heads % k == 0)
        return cls(
            hidden_size=hidden_size,
            vocab_size=vocab_size,
            num_hidden_layers=num_hidden_layers,
            num_attention_heads=num_attention_heads,
            num_key_value_heads=num_key_value_heads,
            head_dim=head_dim,
            intermediate_size=intermediate_size or 3 * hidden_size,
            rms_norm_eps=rms_norm_eps,
            rope_theta=rope_theta,
            max_position_embeddings=max_position_embeddings,
            block_size=block_size,
            num_target_layers=num_target_layers,
            mask_token_id=vocab_size - 1 if mask_token_id is None else mask_token_id,
            target_layer_ids=target_layer_ids
            or default_tap_layers(num_target_layers, num_hidden_layers),
        )

    def to_hf_dict(self) -> dict[str, Any]:
        """The ``config.json`` object (a transformers ``Qwen3Config`` plus the DFlash keys)."""
        sliding = self.layer_types is not None and "sliding_attention" in self.layer_types
        out: dict[str, Any] = {
            "architectures": [ARCHITECTURE],
            "model_type": MODEL_TYPE,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_position_embeddings,
            "vocab_size": self.vocab_size,
            "attention_bias": self.attention_bias,
            "attention_dropout": 0.0,
            "tie_word_embeddings": False,
            "use_cache": True,
            "torch_dtype": "bfloat16",
            "block_size": self.block_size,
            "num_target_layers": self.num_target_layers,
            "dflash_config": {
                "mask_token_id": self.mask_token_id,
                "target_layer_ids": list(self.target_layer_ids),
            },
        }
        if self.rope_scaling is not None:
            out["rope_scaling"] = dict(self.rope_scaling)
        if self.layer_types is not None:
            out["layer_types"] = list(self.layer_types)
            out["use_sliding_window"] = sliding
            out["max_window_layers"] = 0
        if self.sliding_window is not None:
            out["sliding_window"] = self.sliding_window
        if self.is_causal is not None:
            out["is_causal"] = self.is_causal
        return out


class DFlash2Config(DFlashConfig):
    """A DFlash2 drafter (``specs/dflash2.md``): a :class:`DFlashConfig` plus the grouped
    dynamic convolutions (``conv_kernel_size`` taps, one coefficient per
    ``conv_group_size`` channels), the candidate selector (``selector_top_k`` candidates
    per slot, a rank-``selector_rank`` bilinear score) and the output scalars."""

    conv_kernel_size: int = Field(ge=1)
    conv_group_size: int = Field(ge=1)
    selector_rank: int = Field(ge=1)
    selector_top_k: int = Field(ge=1)
    input_embedding_scale: float = Field(default=1.0, allow_inf_nan=False)
    output_multiplier: float = Field(default=1.0, gt=0.0, allow_inf_nan=False)
    final_logit_softcapping: float | None = Field(default=None, gt=0.0, allow_inf_nan=False)
    """``None``: no soft cap (a config's ``null`` or a value <= 0)."""
    declares_target_depth: bool = True
    """False: the ``config.json`` left ``num_target_layers`` out (DFlash2's reference never
    reads it); ``num_target_layers`` is then the taps' bound, not the target's depth, and
    only the taps are checked against the target."""

    @model_validator(mode="after")
    def _check_dflash2(self) -> DFlash2Config:
        if self.hidden_size % self.conv_group_size != 0:
            raise ValueError(
                f"'conv_group_size' ({self.conv_group_size}) must divide 'hidden_size' "
                f"({self.hidden_size})"
            )
        if self.selector_top_k > self.vocab_size:
            raise ValueError(
                f"'selector_top_k' must be <= vocab_size={self.vocab_size} "
                f"(got {self.selector_top_k})"
            )
        return self

    @property
    def conv_groups(self) -> int:
        """Channel groups sharing one dynamic coefficient: ``hidden_size / conv_group_size``."""
        return self.hidden_size // self.conv_group_size

    def to_hf_dict(self) -> dict[str, Any]:
        """The ``config.json`` object: v1's, with DFlash2's architecture, ``block_size``
        inside ``dflash_config`` (where the published checkpoints keep it) and the new keys."""
        out = super().to_hf_dict()
        out["architectures"] = [ARCHITECTURE_V2]
        out.pop("block_size")
        if not self.declares_target_depth:
            out.pop("num_target_layers")
        out["dflash_config"] |= {
            "block_size": self.block_size,
            "conv_kernel_size": self.conv_kernel_size,
            "conv_group_size": self.conv_group_size,
            "selector_rank": self.selector_rank,
            "selector_top_k": self.selector_top_k,
            "input_embedding_scale": self.input_embedding_scale,
            "output_multiplier": self.output_multiplier,
            "final_logit_softcapping": self.final_logit_softcapping,
        }
        return out


def default_tap_layers(num_target_layers: int, num_draft_layers: int) -> tuple[int, ...]:
    """z-lab's default ``target_layer_ids``: one tap per drafter layer.

    One drafter layer taps the middle target layer ``N // 2``; ``n >= 2`` layers tap ``n``
    layers spread evenly from layer 1 to layer ``N - 3`` (``round`` of the even spacing).
    Duplicates (very shallow targets) are dropped and layers clamped into ``[0, N)``.
    """
    if num_target_layers < 1 or num_draft_layers < 1:
        raise ValueError(
            f"'num_target_layers' and 'num_draft_layers' must be >= 1 "
            f"(got {num_target_layers}, {num_draft_layers})"
        )
    if num_draft_layers == 1:
        return (num_target_layers // 2,)
    start, end = 1, num_target_layers - 3
    raw = [
        round(start + i * (end - start) / (num_draft_layers - 1)) for i in range(num_draft_layers)
    ]
    taps: list[int] = []
    for layer in raw:
        layer = min(max(layer, 0), num_target_layers - 1)
        if layer not in taps:
            taps.append(layer)
    return tuple(taps)


def _check_rope_scaling(scaling: Mapping[str, Any] | None) -> None:
    if scaling is None:
        return
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise ValueError(
            f"'rope_scaling' rope_type must be one of {list(ROPE_TYPES)} (got {kind!r})"
        )
    if kind in ("linear", "yarn"):
        factor = scaling.get("factor")
        if not isinstance(factor, (int, float)) or isinstance(factor, bool) or factor <= 0:
            raise ValueError(f"'rope_scaling' {kind} needs a 'factor' > 0 (got {factor!r})")
        if not math.isfinite(float(factor)):
            raise ValueError(f"'rope_scaling' factor must be finite (got {factor!r})")
