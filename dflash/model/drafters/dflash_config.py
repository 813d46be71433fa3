"""Configuration of the DFlash block drafter (frozen, validated, JSON round-trippable)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class DFlashConfig(BaseModel):
    """Shapes of a DFlash block drafter.

    The drafter shares the target's token embedding and LM head, so ``hidden_size`` and
    ``vocab_size`` are the target's. Its context projection maps the concatenated hidden
    states of ``tap_layers`` (``len(tap_layers) * hidden_size`` wide) to ``hidden_size``.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    format: Literal["dflash-drafter"] = "dflash-drafter"
    hidden_size: int = Field(ge=1)
    vocab_size: int = Field(ge=2)
    num_layers: int = Field(ge=1)
    num_heads: int = Field(ge=1)
    num_kv_heads: int = Field(ge=1)
    head_dim: int = Field(ge=2)
    intermediate_size: int = Field(ge=1)
    tap_layers: tuple[int, ...] = Field(min_length=1)
    mask_token_id: int = Field(ge=0)
    rms_norm_eps: float = Field(default=1e-6, gt=0.0, lt=1.0)
    rope_theta: float = Field(default=1_000_000.0, gt=0.0)
    context_window: int | None = Field(default=None, ge=1)
    """Use only the last ``context_window`` feature rows (``None``: all of them)."""

    @model_validator(mode="after")
    def _check_consistency(self) -> DFlashConfig:
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(
                f"'num_heads' ({self.num_heads}) must be a multiple of "
                f"'num_kv_heads' ({self.num_kv_heads})"
            )
        if self.head_dim % 2 != 0:
            raise ValueError(f"'head_dim' must be even for rotary embedding (got {self.head_dim})")
        if self.mask_token_id >= self.vocab_size:
            raise ValueError(
                f"'mask_token_id' must be < vocab_size={self.vocab_size} (got {self.mask_token_id})"
            )
        for i, layer in enumerate(self.tap_layers):
            if layer < 0:
                raise ValueError(f"'tap_layers'[{i}] must be >= 0 (got {layer})")
        if len(set(self.tap_layers)) != len(self.tap_layers):
            raise ValueError(f"'tap_layers' must be distinct (got {list(self.tap_layers)})")
        return self

    @property
    def feature_size(self) -> int:
        """Width of the ``features`` rows the drafter takes: ``len(tap_layers) * hidden_size``."""
        return len(self.tap_layers) * self.hidden_size

    @classmethod
    def for_target(
        cls,
        hidden_size: int,
        vocab_size: int,
        num_target_layers: int,
        *,
        num_layers: int = 2,
        num_taps: int = 3,
        mask_token_id: int | None = None,
    ) -> DFlashConfig:
        """A small drafter shaped for a target: head_dim <= 128 dividing ``hidden_size`` with
        at least two heads where possible, two KV heads where possible, taps spread evenly."""
        divisors = [d for d in (128, 64, 32, 16, 8, 4, 2) if hidden_size % d == 0]
        head_dim = next((d for d in divisors if hidden_size // d >= 2), 2)
        num_heads = max(1, hidden_size // head_dim)
        num_kv_heads = next(k for k in (2, 1) if num_heads % k == 0)
        return cls(
            hidden_size=hidden_size,
            vocab_size=vocab_size,
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            intermediate_size=3 * hidden_size,
            tap_layers=default_tap_layers(num_target_layers, num_taps),
            mask_token_id=vocab_size - 1 if mask_token_id is None else mask_token_id,
        )


def default_tap_layers(num_target_layers: int, count: int) -> tuple[int, ...]:
    """``count`` distinct layers spread evenly from the first to the second-to-last layer."""
    if num_target_layers < 1 or count < 1:
        raise ValueError(
            f"'num_target_layers' and 'count' must be >= 1 (got {num_target_layers}, {count})"
        )
    last = max(0, num_target_layers - 2)
    count = min(count, last + 1)
    if count == 1:
        return (last // 2,)
    return tuple(sorted({round(i * last / (count - 1)) for i in range(count)}))
