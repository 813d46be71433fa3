"""Layers of the DFlash block drafter: RMSNorm, rotary embedding, context attention, MLP.

The block's queries attend, with no causal mask, to keys/values made from the projected
target context features followed by the block itself: every block position sees the whole
context and the whole block (bidirectional drafting in one pass).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dflash.model.drafters.dflash_config import DFlashConfig

Rope = tuple[Tensor, Tensor]  # (cos, sin), each [T, head_dim]


class RMSNorm(nn.Module):
    """``x / rms(x) * weight`` over the last axis, computed in float32."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * self.weight.float()).to(x.dtype)


def rotary_cos_sin(positions: Tensor, head_dim: int, theta: float) -> tuple[Tensor, Tensor]:
    """cos, sin: [T, head_dim] for the half-split rotary embedding at ``positions`` [T]."""
    inv_freq = 1.0 / theta ** (
        torch.arange(0, head_dim, 2, dtype=torch.float32, device=positions.device) / head_dim
    )
    freqs = positions.float()[:, None] * inv_freq[None, :]  # [T, head_dim/2]
    angles = torch.cat([freqs, freqs], dim=-1)  # [T, head_dim]
    return angles.cos(), angles.sin()


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x: [T, heads, head_dim]; rotates the two halves of each head by the position angle."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    x32 = x.float() * cos[:, None, :] + rotated.float() * sin[:, None, :]
    return x32.to(x.dtype)


class ContextAttention(nn.Module):
    """Block queries over [context features ; block] keys/values, grouped KV heads, no mask."""

    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads
        self.num_kv_heads = cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def forward(self, x: Tensor, context: Tensor, rope_q: Rope, rope_k: Rope) -> Tensor:
        # x: [Tb, H] block   context: [Tc, H] projected features
        # rope_q: cos, sin [Tb, D]   rope_k: cos, sin [Tc+Tb, D] (context positions first)
        tb = x.shape[0]
        kv_in = torch.cat([context, x], dim=0)  # [Tc+Tb, H]
        q = self.q_norm(self.q_proj(x).view(tb, self.num_heads, self.head_dim))
        k = self.k_norm(self.k_proj(kv_in).view(-1, self.num_kv_heads, self.head_dim))
        v = self.v_proj(kv_in).view(-1, self.num_kv_heads, self.head_dim)
        q = apply_rotary(q, *rope_q)  # [Tb, NH, D]
        k = apply_rotary(k, *rope_k)  # [Tc+Tb, NKV, D]
        group = self.num_heads // self.num_kv_heads
        k = k.repeat_interleave(group, dim=1)  # [Tc+Tb, NH, D]
        v = v.repeat_interleave(group, dim=1)
        # [NH, Tb, D] attends to [NH, Tc+Tb, D] with no mask: bidirectional over the block
        o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1))
        out: Tensor = self.o_proj(o.transpose(0, 1).reshape(tb, self.num_heads * self.head_dim))
        return out


class SwiGLU(nn.Module):
    """``down(silu(gate(x)) * up(x))``."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return out


class DrafterLayer(nn.Module):
    """Pre-norm residual layer: context attention, then SwiGLU MLP."""

    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = ContextAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x: Tensor, context: Tensor, rope_q: Rope, rope_k: Rope) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), context, rope_q, rope_k)
        out: Tensor = x + self.mlp(self.post_attention_layernorm(x))
        return out
