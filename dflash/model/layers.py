"""Layer maths of the hybrid model: norms, rotary embedding, MLP and the two mixers.

Parameter names mirror the Hugging Face Qwen3.5 modules so checkpoints map 1:1
(``layers.{i}.linear_attn.in_proj_qkv.weight`` …). The mixers read and write their
caches through the views handed to them by :class:`dflash.model.target.TargetModel`;
the recurrent maths runs in :mod:`dflash.kernels` (Triton on CUDA, reference on CPU).
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dflash.geometry import ChainGeometry
from dflash.kernels import causal_conv1d_capture, gdn_verify, rms_norm
from dflash.model.config import HybridConfig

KernelBackend = Literal["auto", "triton", "reference"]


def _norm_backend(x: Tensor) -> KernelBackend:
    """Norms run the Triton kernel on CUDA and the torch reference elsewhere."""
    return "auto" if x.is_cuda else "reference"


class RMSNorm(nn.Module):
    """Zero-centred RMSNorm: ``x / rms(x) * (1 + weight)``, computed in float32."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: Tensor) -> Tensor:
        # one fused launch on CUDA (the torch formulation is eight); reference on CPU
        return rms_norm(x, self.weight, self.eps, zero_centred=True, backend=_norm_backend(x))


class GatedRMSNorm(nn.Module):
    """Output norm of Gated DeltaNet: ``weight · x / rms(x) · silu(z)`` per value head."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor, z: Tensor) -> Tensor:
        return rms_norm(
            x, self.weight, self.eps, zero_centred=False, gate=z, backend=_norm_backend(x)
        )


class MLP(nn.Module):
    """SwiGLU MLP: ``down(silu(gate(x)) · up(x))``."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return out


def rotary_cos_sin(
    config: HybridConfig, positions: Tensor, dtype: torch.dtype
) -> tuple[Tensor, Tensor]:
    """cos/sin tables ``[T, rotary_dim]`` for integer ``positions`` ``[T]`` (float32 maths)."""
    dim = config.rotary_dim
    exponent = torch.arange(0, dim, 2, dtype=torch.float32, device=positions.device) / dim
    inv_freq = 1.0 / (config.rope_theta**exponent)
    freqs = positions.float()[:, None] * inv_freq[None, :]  # [T, dim/2]
    angles = torch.cat((freqs, freqs), dim=-1)  # [T, dim]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate the first ``rotary_dim`` channels of ``x: [B, T, H, D]`` (rotate-half form)."""
    dim = cos.shape[-1]
    rot, keep = x[..., :dim], x[..., dim:]
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    half = dim // 2
    rotated = torch.cat((-rot[..., half:], rot[..., :half]), dim=-1)
    return torch.cat((rot * cos + rotated * sin, keep), dim=-1)


class GatedAttention(nn.Module):
    """Full attention with q/k RMSNorm, partial rotary, grouped KV heads and an output gate.

    ``q_proj`` yields, per query head, ``[query (D) | gate (D)]``; the attention output is
    multiplied by ``sigmoid(gate)`` before ``o_proj``.
    """

    def __init__(self, config: HybridConfig) -> None:
        super().__init__()
        h, d, bias = config.hidden_size, config.head_dim, config.attention_bias
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = d
        self.q_proj = nn.Linear(h, self.num_heads * d * 2, bias=bias)
        self.k_proj = nn.Linear(h, self.num_kv_heads * d, bias=bias)
        self.v_proj = nn.Linear(h, self.num_kv_heads * d, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=bias)
        self.q_norm = RMSNorm(d, config.rms_norm_eps)
        self.k_norm = RMSNorm(d, config.rms_norm_eps)

    def forward(
        self,
        x: Tensor,
        cos: Tensor,
        sin: Tensor,
        k_cache: Tensor,
        v_cache: Tensor,
        start: int,
        visible: Tensor | None,
    ) -> Tensor:
        """``x: [B, T, hidden]`` at positions ``start … start+T-1``.

        ``k_cache, v_cache: [B, HKV, max_len, D]`` receive this step's keys/values; the
        queries attend to cache rows ``0 … start+T-1``. ``visible: [T, start+T]`` bool
        (True = may attend) or None for "all rows" (single-token decode).
        """
        b, t, _ = x.shape
        d = self.head_dim
        q_and_gate = self.q_proj(x).view(b, t, self.num_heads, 2 * d)
        q, gate = q_and_gate[..., :d], q_and_gate[..., d:]
        q = apply_rotary(self.q_norm(q), cos, sin)  # [B, T, H, D]
        k = apply_rotary(self.k_norm(self.k_proj(x).view(b, t, self.num_kv_heads, d)), cos, sin)
        v = self.v_proj(x).view(b, t, self.num_kv_heads, d)
        end = start + t
        k_cache[:, :, start:end] = k.transpose(1, 2)
        v_cache[:, :, start:end] = v.transpose(1, 2)
        keys = k_cache[:, :, :end]  # [B, HKV, start+T, D]
        values = v_cache[:, :, :end]
        # Grouped heads without copying the cache: query head h = kv * G + g reads KV head
        # kv, so the G query heads of one KV head become G*T query rows of that head.
        groups = self.num_heads // self.num_kv_heads
        q_rows = q.transpose(1, 2).reshape(b, self.num_kv_heads, groups * t, d)
        mask = None if visible is None else visible.repeat(groups, 1)  # [G*T, start+T]
        out = F.scaled_dot_product_attention(q_rows, keys, values, attn_mask=mask, scale=d**-0.5)
        out = out.reshape(b, self.num_heads, t, d).transpose(1, 2).reshape(b, t, self.num_heads * d)
        out = out * torch.sigmoid(gate.reshape(b, t, self.num_heads * d))
        result: Tensor = self.o_proj(out)
        return result


class GatedDeltaNet(nn.Module):
    """Gated DeltaNet mixer: projections, causal conv, gated delta rule, gated RMSNorm.

    ``in_proj_qkv`` feeds the causal conv over ``conv_dim = 2·HK·K + HV·V`` channels
    (q, k, v in that order, head-major); ``in_proj_z`` the output gate; ``in_proj_b``
    → ``beta = sigmoid(b)``; ``in_proj_a`` → ``g = -exp(A_log) · softplus(a + dt_bias)``.
    """

    def __init__(self, config: HybridConfig) -> None:
        super().__init__()
        h, hv = config.hidden_size, config.linear_num_value_heads
        self.num_k_heads, self.num_v_heads = config.linear_num_key_heads, hv
        self.key_dim, self.value_dim = config.linear_key_dim, config.linear_value_dim
        self.head_k_dim, self.head_v_dim = config.linear_key_head_dim, config.linear_value_head_dim
        self.conv_kernel = config.linear_conv_kernel_dim
        self.in_proj_qkv = nn.Linear(h, config.conv_dim, bias=False)
        self.in_proj_z = nn.Linear(h, config.linear_value_dim, bias=False)
        self.in_proj_b = nn.Linear(h, hv, bias=False)
        self.in_proj_a = nn.Linear(h, hv, bias=False)
        self.conv1d = nn.Conv1d(
            config.conv_dim,
            config.conv_dim,
            kernel_size=config.linear_conv_kernel_dim,
            groups=config.conv_dim,
            bias=False,
            padding=config.linear_conv_kernel_dim - 1,
        )
        self.dt_bias = nn.Parameter(torch.ones(hv))
        self.A_log = nn.Parameter(torch.zeros(hv))
        self.norm = GatedRMSNorm(config.linear_value_head_dim, config.rms_norm_eps)
        self.out_proj = nn.Linear(config.linear_value_dim, h, bias=False)

    def forward(
        self,
        x: Tensor,
        state: Tensor,
        conv_rows: Tensor,
        geometry: ChainGeometry | None,
        capture: tuple[Tensor, Tensor, Tensor] | None,
        backend: KernelBackend,
    ) -> Tensor:
        """``x: [B, T, hidden]`` → ``[B, T, hidden]``.

        ``state: [B, HV, K, V]`` f32 and ``conv_rows: [B, Kc-1, C]`` are the live recurrent
        state and conv window (views into the pool). ``capture`` is None to advance them in
        place (prefill / decode / replay), or ``(checkpoints [B, S, HV, K, V],
        captured [B, Kc-1+S, C], snapshot [B, HV, K, V])`` for verify: the per-token states
        and conv inputs go there, the pre-verify state into ``snapshot``, and the live
        ``state``/``conv_rows`` are only read (``geometry`` is the validated chain).
        """
        b, t, _ = x.shape
        kc1 = self.conv_kernel - 1
        mixed = self.in_proj_qkv(x)  # [B, T, C]
        z = self.in_proj_z(x).view(b, t, self.num_v_heads, self.head_v_dim)
        beta = torch.sigmoid(self.in_proj_b(x))  # [B, T, HV]
        g = -self.A_log.float().exp() * F.softplus(self.in_proj_a(x).float() + self.dt_bias)
        weight = self.conv1d.weight.squeeze(1)  # [C, Kc]
        if capture is None:  # in place: conv inputs go to scratch, the new window is its tail
            captured = mixed.new_empty(b, kc1 + t, mixed.shape[-1])
        else:
            checkpoints, captured, snapshot = capture
        mixed = causal_conv1d_capture(mixed, conv_rows, weight, None, captured, backend=backend)
        q, k, v = torch.split(mixed, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = q.reshape(b, t, self.num_k_heads, self.head_k_dim)
        k = k.reshape(b, t, self.num_k_heads, self.head_k_dim)
        v = v.reshape(b, t, self.num_v_heads, self.head_v_dim)
        if capture is None:
            conv_rows.copy_(captured[:, t : t + kc1])
            o = gdn_verify(  # state <- state after the last token, in place
                q, k, v, g, beta, state, state.unsqueeze(1), None,
                final_state_only=True, backend=backend,
            )
        else:
            o = gdn_verify(
                q, k, v, g, beta, state, checkpoints, geometry,
                snapshot=snapshot, backend=backend,
            )
        o = self.norm(o, z)  # [B, T, HV, V]
        out: Tensor = self.out_proj(o.reshape(b, t, self.value_dim))
        return out


class DecoderLayer(nn.Module):
    """Pre-norm residual block: ``x + mixer(norm(x))`` then ``x + mlp(norm(x))``.

    The MLP is dense, or a sparse mixture of experts in ``config.sparse_layer_ids``.
    """

    def __init__(self, config: HybridConfig, layer_id: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp: nn.Module
        if layer_id in config.sparse_layer_ids:
            from dflash.model.moe import SparseMoE

            self.mlp = SparseMoE(config)
        else:
            self.mlp = MLP(config.hidden_size, config.intermediate_size)


class DeltaNetLayer(DecoderLayer):
    """A recurrent (``linear_attention``) layer: Gated DeltaNet mixer + MLP."""

    def __init__(self, config: HybridConfig, layer_id: int) -> None:
        super().__init__(config, layer_id)
        self.linear_attn = GatedDeltaNet(config)


class AttentionLayer(DecoderLayer):
    """A ``full_attention`` layer: gated attention mixer + MLP."""

    def __init__(self, config: HybridConfig, layer_id: int) -> None:
        super().__init__(config, layer_id)
        self.self_attn = GatedAttention(config)
