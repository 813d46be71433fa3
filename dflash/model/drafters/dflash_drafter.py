"""The DFlash block drafter: one bidirectional pass over ``[last, mask × (B-1)]``.

Context conditioning: the target's hidden states at ``tap_layers`` for the committed tokens
(``features`` ``[Tc, len(tap_layers) * H]``) are projected to ``[Tc, H]`` once per call and
used as extra keys/values in every drafter layer. The block's queries attend, unmasked, to
those context entries and to the whole block, so every position sees every other one. The
token embedding and LM head are the target's own tensors, held by reference: they are not
parameters of the drafter, not copied and not saved with it.

Greedy proposal: the argmax of the logits at each mask position (slots 1..B-1).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dflash.model.drafters.base import check_block_size, check_context, check_token
from dflash.model.drafters.dflash_checkpoint import (
    read_config,
    read_weights,
    write_checkpoint,
)
from dflash.model.drafters.dflash_config import DFlashConfig
from dflash.model.drafters.dflash_layers import DrafterLayer, RMSNorm, rotary_cos_sin
from dflash.model.drafters.errors import DraftArgumentError, TargetMismatchError

_O_PROJ_GAIN = 4.0  # see DFlashDrafter.random


class DFlashDrafter(nn.Module):
    """DFlash block drafter sharing the target's embedding and LM head (see module doc)."""

    label = "dflash"
    _embed_weight: Tensor  # [V, H], the target's, by reference
    _lm_head_weight: Tensor  # [V, H], the target's, by reference

    def __init__(self, config: DFlashConfig, embed_weight: Tensor, lm_head_weight: Tensor) -> None:
        """Build with parameters left to ``torch.nn`` defaults; prefer :meth:`random` or
        :meth:`from_pretrained`, which set every parameter deterministically."""
        super().__init__()
        _check_target_weight("embed_weight", embed_weight, config)
        _check_target_weight("lm_head_weight", lm_head_weight, config)
        self.config = config
        self.fc = nn.Linear(config.feature_size, config.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.layers = nn.ModuleList(DrafterLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # plain attributes, not submodules/parameters: shared with the target, never saved
        object.__setattr__(self, "_embed_weight", embed_weight)
        object.__setattr__(self, "_lm_head_weight", lm_head_weight)

    @property
    def tap_layers(self) -> tuple[int, ...]:
        return self.config.tap_layers

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.fc.weight.device

    # -- construction -------------------------------------------------------------------

    @classmethod
    def _empty(
        cls,
        config: DFlashConfig,
        embed_weight: Tensor,
        lm_head_weight: Tensor,
        dtype: torch.dtype | None,
    ) -> DFlashDrafter:
        # shapes only (meta device: no init work, global RNG untouched), then real storage
        with torch.device("meta"):
            drafter = cls(config, embed_weight, lm_head_weight)
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
    ) -> DFlashDrafter:
        """Seeded random weights, drawn on the CPU in float32 in parameter-name order, so the
        same seed gives the same drafter on any device; ``dtype`` defaults to the embedding's.

        Norms are 1 and linear weights N(0, 1/fan_in), except the attention output
        projections, N(0, 16/fan_in): with unit-scale target embeddings the untrained drafter
        would otherwise repeat whatever the mask embedding maps to, whereas this way the
        attended context drives its output, as it does in a trained drafter.
        """
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise DraftArgumentError(f"'seed' must be an int >= 0 (got {seed!r})")
        drafter = cls._empty(config, embed_weight, lm_head_weight, dtype)
        gen = torch.Generator(device="cpu").manual_seed(seed)
        with torch.no_grad():
            for name, param in sorted(drafter.named_parameters()):
                if name.endswith("norm.weight"):
                    value = torch.ones(param.shape)
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
        dtype: torch.dtype | None = None,
    ) -> DFlashDrafter:
        """Load ``directory/{config.json, model.safetensors}``; typed errors on any problem."""
        config = read_config(directory)
        drafter = cls._empty(config, embed_weight, lm_head_weight, dtype)
        shapes = {k: tuple(v.shape) for k, v in drafter.state_dict().items()}
        tensors = read_weights(directory, shapes)
        with torch.no_grad():
            for name, param in drafter.state_dict().items():
                param.copy_(tensors[name])
        return drafter.eval().requires_grad_(False)

    def save_pretrained(self, directory: str | Path) -> None:
        """Write ``config.json`` and ``model.safetensors`` (the drafter's own weights only)."""
        write_checkpoint(directory, self.config, self.state_dict())

    # -- drafting -----------------------------------------------------------------------

    def block_hidden(self, block: Tensor, features: Tensor, position: int) -> Tensor:
        """Final-norm hidden states ``[Tb, H]`` of the drafter over the token ids ``block``.

        ``block`` ``[Tb]`` occupies positions ``position .. position+Tb-1``; ``features``
        ``[Tc, F]`` are the context rows at positions ``position-Tc .. position-1``.
        """
        cfg = self.config
        embed = self._embed_weight
        x = F.embedding(block.to(embed.device), embed).to(self.device, self.dtype)  # [Tb, H]
        if cfg.context_window is not None:
            features = features[-cfg.context_window :]
        context = self.hidden_norm(self.fc(features.to(self.device, self.dtype)))  # [Tc, H]
        tc, tb = context.shape[0], x.shape[0]
        positions = torch.arange(position - tc, position + tb, device=self.device)
        cos, sin = rotary_cos_sin(positions, cfg.head_dim, cfg.rope_theta)  # [Tc+Tb, D]
        for layer in self.layers:
            x = layer(x, context, (cos[tc:], sin[tc:]), (cos, sin))
        out: Tensor = self.norm(x)
        return out

    def logits(self, hidden: Tensor) -> Tensor:
        """``[..., V]`` logits through the target's LM head (on the LM head's device, which
        may differ from the embedding's when the target is split across devices)."""
        weight = self._lm_head_weight
        return F.linear(hidden.to(weight.device, weight.dtype), weight)

    def propose(
        self, context: list[int], last: int, block_size: int, features: Tensor | None
    ) -> list[int]:
        """Greedy block proposal: ``block_size - 1`` argmax tokens, one forward pass."""
        check_block_size(block_size)
        check_token("last", last, self.config.vocab_size)
        n_context = len(check_context(context, check_tokens=False))
        features = self._check_features(features, n_context)
        block = torch.full((block_size,), self.config.mask_token_id, dtype=torch.long)
        block[0] = last  # [last, mask × (B-1)]
        with torch.no_grad():
            hidden = self.block_hidden(block, features, n_context)  # one pass over the block
            logits = self.logits(hidden[1:])  # [B-1, V]: the mask slots
        return [int(t) for t in logits.argmax(dim=-1).tolist()]

    def _check_features(self, features: Tensor | None, n_context: int) -> Tensor:
        width = self.config.feature_size
        if features is None:
            raise DraftArgumentError(
                f"'features' is required by the DFlash drafter: [T, {width}] tap hidden states "
                f"of tap_layers {list(self.tap_layers)} (got None)"
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


def _check_target_weight(name: str, weight: object, config: DFlashConfig) -> None:
    expected = [config.vocab_size, config.hidden_size]
    if not isinstance(weight, Tensor):
        raise TargetMismatchError(f"{name!r} must be a torch.Tensor (got {type(weight).__name__})")
    if list(weight.shape) != expected:
        raise TargetMismatchError(
            f"{name!r} has shape {list(weight.shape)}, the drafter config needs "
            f"[vocab_size, hidden_size] = {expected}"
        )
