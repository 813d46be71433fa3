"""Layers of the DFlash block drafter (Qwen3 layers with context keys/values).

Each drafter layer is a Qwen3 decoder layer whose attention takes two inputs: the block
(``[last, mask × (B-1)]``, embedded with the target's embedding) gives the queries and the
block keys/values; the projected target context (``hidden_norm(fc(features))``, the same
for every layer) gives extra keys/values through the *same* ``k_proj`` / ``v_proj`` /
``k_norm``. Context keys are rotated at their own positions ``0 … committed-1``, block
queries and keys at ``committed … committed+B-1``; context keys/values of committed
tokens never change, so the drafter caches them per layer.

Maths (Qwen3): ``RMSNorm(x) = weight * (x / sqrt(mean(x²) + eps))`` (plain weight, not
``1 + weight``), normalised in float32 and cast back before the weight multiplies;
per-head RMSNorm on queries and keys before the rotary embedding; half-split rotary
embedding (``x * cos + rotate_half(x) * sin``); SwiGLU MLP ``down(silu(gate x) * up x)``.

Product dtype: while drafting, the linear products (the projections, the MLP, ``fc``, the
LM head) multiply in the dtype set by :func:`products_in` — the drafter's ``draft_dtype``,
or, when that is None, each weight's own dtype — and their results return to the rows'
dtype; norms, the rotary embedding, attention and the residual sums stay in the rows'
dtype. Nothing is timed or chosen per machine. Training runs outside :func:`products_in`,
on the weights as they are.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from dflash.model.drafters.dflash_config import DFlashConfig

#: SDPA backends for the drafter's attention. cuDNN is left out: it builds a new plan for
#: every new key length (milliseconds of host time per call), and the context grows by
#: every committed token, so each step would plan again; flash / memory-efficient kernels
#: launch directly.
_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
_MATH_ONLY: ContextVar[bool] = ContextVar("dflash_drafter_math_attention", default=False)
#: the dtype the drafting products multiply in (None: each weight's own), see products_in
_PRODUCTS: ContextVar[torch.dtype | None] = ContextVar("dflash_drafter_products", default=None)


@contextmanager
def math_attention() -> Iterator[None]:
    """Run the drafter's attention on SDPA's math backend inside this block.

    The math backend is plain matmuls and a softmax, whose backward is deterministic; the
    fused kernels' backward accumulates with atomics, so two GPU training runs with the
    same seed would drift apart. ``train_drafter`` runs every training step under it (the
    blocks' own attention, :func:`blocked_attention`, is plain matmuls and needs no
    backend; this covers any SDPA call in the step, such as the dense reference form).
    """
    token = _MATH_ONLY.set(True)
    try:
        yield
    finally:
        _MATH_ONLY.reset(token)


def attention_backends() -> list[SDPBackend]:
    """The SDPA backends the drafter's attention may use here (see :func:`math_attention`)."""
    return [SDPBackend.MATH] if _MATH_ONLY.get() else list(_BACKENDS)


@contextmanager
def products_in(dtype: torch.dtype | None) -> Iterator[None]:
    """Run the drafter's linear products in ``dtype`` inside this block (None: each weight's
    own dtype); see the module docstring. The drafter's drafting methods enter it with its
    ``draft_dtype``; a CUDA graph captured inside it keeps the products it captured."""
    token = _PRODUCTS.set(dtype)
    try:
        yield
    finally:
        _PRODUCTS.reset(token)


def product_dtype(weight: Tensor) -> torch.dtype:
    """The dtype a product with ``weight`` multiplies in here: that of :func:`products_in`,
    else the weight's own."""
    return _PRODUCTS.get() or weight.dtype


class ProductLinear(nn.Linear):
    """:class:`torch.nn.Linear` whose product multiplies in :func:`product_dtype`: where that
    differs from the weight's dtype, ``x`` and a copy of the weight in that dtype (made
    again when the weight's storage or version counter moves) are multiplied, and the
    result returns to ``x``'s dtype before the bias is added. Otherwise (and outside
    :func:`products_in`, as in training) it is ``nn.Linear`` itself; its parameters and
    their names are ``nn.Linear``'s."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self._copy: tuple[tuple[int, int, torch.dtype], Tensor] | None = None

    def forward(self, x: Tensor) -> Tensor:
        weight = self.weight
        dtype = product_dtype(weight)
        if dtype == weight.dtype:
            return F.linear(x, weight, self.bias)
        key = (weight.data_ptr(), -1 if weight.is_inference() else weight._version, dtype)
        if self._copy is None or self._copy[0] != key:
            with torch.no_grad():
                self._copy = (key, weight.detach().to(dtype))
        y = F.linear(x.to(dtype), self._copy[1]).to(x.dtype)
        return y if self.bias is None else y + self.bias


class RMSNorm(nn.Module):
    """Qwen3's RMSNorm: ``weight * (x / rms(x))``, the normalisation in float32."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.weight * rms_normalized(x, self.eps)
        return out


def rms_normalized(x: Tensor, eps: float) -> Tensor:
    """``x / sqrt(mean(x²) + eps)`` over the last dimension, computed in float32."""
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def inverse_frequencies(config: DFlashConfig) -> tuple[Tensor, float]:
    """``(inv_freq [head_dim/2] float32, attention_scale)`` for the config's rotary embedding.

    ``default``: ``theta^(-2i/D)``; ``linear``: divided by ``factor``; ``yarn`` (YaRN,
    Peng et al. 2023): per frequency, a ramp between interpolation (divided by ``factor``)
    for long wavelengths and extrapolation (unchanged) for short ones, between the
    correction dimensions of ``beta_fast`` / ``beta_slow`` rotations over the original
    context, and ``cos``/``sin`` scaled by ``0.1 ln(factor) + 1`` (or the ``mscale`` ratio).
    """
    dim, base = config.head_dim, config.rope_theta
    exponents = torch.arange(0, dim, 2, dtype=torch.float32, device="cpu") / dim
    inv_freq = 1.0 / (base**exponents)
    scaling = config.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv_freq, 1.0
    factor = float(scaling["factor"])
    if kind == "linear":
        return inv_freq / factor, 1.0
    original = float(
        scaling.get("original_max_position_embeddings") or config.max_position_embeddings
    )
    beta_fast = float(scaling.get("beta_fast") or 32.0)
    beta_slow = float(scaling.get("beta_slow") or 1.0)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    index = torch.arange(dim // 2, dtype=torch.float32, device="cpu")
    ramp = ((index - low) / (high - low)).clamp(0, 1)
    extrapolate = 1.0 - ramp
    blended = (inv_freq / factor) * (1.0 - extrapolate) + inv_freq * extrapolate

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    given = scaling.get("attention_factor")
    m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if given is not None:
        attention = float(given)
    elif m and m_all:
        attention = mscale(factor, float(m)) / mscale(factor, float(m_all))
    else:
        attention = mscale(factor)
    return blended, attention


class Rotary:
    """cos/sin tables of the config's rotary embedding at given positions."""

    def __init__(self, config: DFlashConfig) -> None:
        self.inv_freq, self.scale = inverse_frequencies(config)
        # per device, made once: a host-to-device copy cannot run inside a CUDA graph
        self._on: dict[torch.device, Tensor] = {self.inv_freq.device: self.inv_freq}

    def __call__(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """positions: [..., T] → cos, sin: [..., T, head_dim] in ``dtype`` (float32 maths)."""
        freqs = self._freqs(positions)
        angles = torch.cat([freqs, freqs], dim=-1)  # [..., T, D]
        return (angles.cos() * self.scale).to(dtype), (angles.sin() * self.scale).to(dtype)

    def rolled(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """positions: [..., T] → ``cos`` and the signed sin ``[-sin_half | sin_half]``:
        [..., T, head_dim] in ``dtype``, the tables of :func:`rotate_rolled`."""
        freqs = self._freqs(positions)
        cos, sin = (freqs.cos() * self.scale).to(dtype), (freqs.sin() * self.scale).to(dtype)
        return torch.cat([cos, cos], dim=-1), torch.cat([-sin, sin], dim=-1)

    def _freqs(self, positions: Tensor) -> Tensor:
        """positions: [..., T] → the rotation angles of each frequency, [..., T, D/2]."""
        inv = self._on.get(positions.device)
        if inv is None:
            inv = self._on.setdefault(positions.device, self.inv_freq.to(positions.device))
        return positions.float()[..., None] * inv


def rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x: [N, heads, T, D]; cos/sin: [N, T, D] → ``x * cos + rotate_half(x) * sin``."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None] + rotated * sin[:, None]


def rotate_rolled(x: Tensor, cos: Tensor, signed_sin: Tensor) -> Tensor:
    """:func:`rotate` on the tables of :meth:`Rotary.rolled`: ``rotate_half(x) * sin`` is
    ``roll(x, D/2) * [-sin_half | sin_half]``, so ``x * cos + roll(x) * signed_sin`` (three
    operations instead of seven, for inference)."""
    rolled = x.roll(x.shape[-1] // 2, dims=-1)
    return torch.addcmul(x * cos[:, None], rolled, signed_sin[:, None])


def normed(x: Tensor, weight: Tensor | None, eps: float) -> Tensor:
    """``weight * rms_normalized(x)`` (``weight`` None: 1) over the last dimension, the
    normalisation in float32: for float32 ``x`` one ``F.rms_norm`` call (for inference;
    :class:`RMSNorm` and :func:`rms_normalized` stay what training runs)."""
    if x.dtype == torch.float32 and (weight is None or weight.dtype == torch.float32):
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    out = F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype)
    return out if weight is None else weight * out


@dataclass(frozen=True)
class BlockedVisibility:
    """Which keys the queries of many anchored blocks see (the training layout).

    The ``Q`` query rows are ``Q / block_size`` blocks of ``block_size`` rows; a block's
    keys are the ``C`` context rows and its own rows, never another block's. ``context``:
    [N, Q, C] bool (True: visible) or None (all visible); ``block``: [N, A, B, B] bool
    (query row, key row within the block) or None (all visible).
    """

    context: Tensor | None
    block: Tensor | None
    block_size: int


def blocked_attention(
    q: Tensor,
    k_ctx: Tensor,
    v_ctx: Tensor,
    k_blk: Tensor,
    v_blk: Tensor,
    visible: BlockedVisibility,
    scale: float,
) -> Tensor:
    """Grouped-query attention of every block over [context ; its own block].

    The same function as attention over [context ; every block] with the other blocks
    masked out, without computing the masked block-to-block scores: each query has
    ``C + B`` scores instead of ``C + Q``. Plain matmuls and a softmax in float32 (float64
    for float64 inputs), whose backward is deterministic; every row must see a key.

    q: [N, heads, Q, D]; k_ctx, v_ctx: [N, kv_heads, C, D]; k_blk, v_blk: [N, kv_heads, Q, D]
    → [N, heads, Q, D].
    """
    n, heads, q_len, d = q.shape
    kv_heads, c, b = k_ctx.shape[1], k_ctx.shape[2], visible.block_size
    if q_len % b:
        raise ValueError(f"{q_len} query rows are not whole blocks of {b}")
    g, a = heads // kv_heads, q_len // b
    # query head h reads kv head h // g: heads grouped as [kv_heads, g]
    s_ctx = torch.matmul(q.reshape(n, kv_heads, g * q_len, d), k_ctx.transpose(-1, -2))
    q_blocks = q.reshape(n, kv_heads, g, a, b, d)
    k_blocks = k_blk.reshape(n, kv_heads, 1, a, b, d)
    s_blk = torch.matmul(q_blocks, k_blocks.transpose(-1, -2))  # [N, kv, g, A, B, B]
    scores = torch.cat(
        [s_ctx.reshape(n, kv_heads, g, q_len, c), s_blk.reshape(n, kv_heads, g, q_len, b)],
        dim=-1,
    )
    scores = scores.to(torch.promote_types(scores.dtype, torch.float32)) * scale
    if visible.context is not None or visible.block is not None:
        ctx_keep = (
            visible.context
            if visible.context is not None
            else torch.ones(n, q_len, c, dtype=torch.bool, device=q.device)
        )
        blk_keep = (
            visible.block.reshape(n, q_len, b)
            if visible.block is not None
            else torch.ones(n, q_len, b, dtype=torch.bool, device=q.device)
        )
        keep = torch.cat([ctx_keep, blk_keep], dim=-1)[:, None, None]  # [N, 1, 1, Q, C+B]
        scores = scores.masked_fill(~keep, float("-inf"))
    p = torch.softmax(scores, dim=-1).to(v_ctx.dtype)
    o_ctx = torch.matmul(p[..., :c].reshape(n, kv_heads, g * q_len, c), v_ctx)
    o_blk = torch.matmul(
        p[..., c:].reshape(n, kv_heads, g, a, b, b), v_blk.reshape(n, kv_heads, 1, a, b, d)
    )
    o = o_ctx.reshape(n, kv_heads, g, q_len, d) + o_blk.reshape(n, kv_heads, g, q_len, d)
    return o.reshape(n, heads, q_len, d)


class DraftAttention(nn.Module):
    """Grouped-query attention of block queries over [context ; block] keys/values."""

    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        bias = cfg.attention_bias
        h = cfg.hidden_size
        q_out, kv_out = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.q_proj = ProductLinear(h, q_out, bias=bias)
        self.k_proj = ProductLinear(h, kv_out, bias=bias)
        self.v_proj = ProductLinear(h, kv_out, bias=bias)
        self.o_proj = ProductLinear(q_out, h, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)

    def keys_values(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        """x: [N, T, H] (context rows or block rows) → rotated k, v: [N, kv_heads, T, D]."""
        n, t, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(n, t, self.num_kv_heads, self.head_dim))
        v = self.v_proj(x).view(n, t, self.num_kv_heads, self.head_dim)
        return rotate(k.transpose(1, 2), cos, sin), v.transpose(1, 2)

    def forward(
        self,
        x: Tensor,
        k_ctx: Tensor,
        v_ctx: Tensor,
        cos: Tensor,
        sin: Tensor,
        visible: Tensor | BlockedVisibility | None,
    ) -> Tensor:
        """Attention of the block over [context ; block].

        Args:
            x: [N, Q, H] the (normed) block rows; cos/sin: [N, Q, D] at their positions.
            k_ctx, v_ctx: [N, kv_heads, C, D] context keys (rotated) / values.
            visible: [N, Q, C+Q] bool (True: key visible), None (every key visible), or a
                :class:`BlockedVisibility` (training: many blocks, each over the context
                and itself only, computed without the blocks' cross terms).

        Returns:
            [N, Q, H].
        """
        n, q_len, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(n, q_len, self.num_heads, self.head_dim))
        q = rotate(q.transpose(1, 2), cos, sin)  # [N, heads, Q, D]
        k_blk, v_blk = self.keys_values(x, cos, sin)  # [N, kv_heads, Q, D]
        if isinstance(visible, BlockedVisibility):
            o = blocked_attention(q, k_ctx, v_ctx, k_blk, v_blk, visible, self.head_dim**-0.5)
            o = o.transpose(1, 2).reshape(n, q_len, self.num_heads * self.head_dim)
            blocked: Tensor = self.o_proj(o)
            return blocked
        k = torch.cat([k_ctx, k_blk], dim=2)  # [N, kv_heads, C+Q, D]
        v = torch.cat([v_ctx, v_blk], dim=2)
        group = self.num_heads // self.num_kv_heads
        if group > 1:  # expand, not repeat_interleave: its backward is a plain sum
            kv_shape = (n, self.num_kv_heads, group, k.shape[2], self.head_dim)
            k = k[:, :, None].expand(kv_shape).reshape(n, self.num_heads, -1, self.head_dim)
            v = v[:, :, None].expand(kv_shape).reshape(n, self.num_heads, -1, self.head_dim)
        mask = None if visible is None else visible[:, None]  # [N, 1, Q, C+Q]
        with sdpa_kernel(attention_backends()):
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.head_dim**-0.5)
        o = o.transpose(1, 2).reshape(n, q_len, self.num_heads * self.head_dim)
        out: Tensor = self.o_proj(o)
        return out


class SwiGLU(nn.Module):
    """``down(silu(gate(x)) * up(x))``."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = ProductLinear(hidden_size, intermediate_size, bias=False)
        self.up_proj = ProductLinear(hidden_size, intermediate_size, bias=False)
        self.down_proj = ProductLinear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return out


class DrafterLayer(nn.Module):
    """Pre-norm residual layer: context attention, then SwiGLU MLP (context is not normed)."""

    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DraftAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size)
        self._packed: PackedLayer | None = None  # see packed()
        self._packed_key: tuple[object, ...] = ()

    def forward(self, x: Tensor, *attn_args: Any) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), *attn_args)
        out: Tensor = x + self.mlp(self.post_attention_layernorm(x))
        return out

    def infer(
        self,
        x: Tensor,
        k_cache: Tensor,
        v_cache: Tensor,
        n: int,
        cos: Tensor,
        signed_sin: Tensor,
        weights: PackedLayer | None = None,
    ) -> Tensor:
        """:meth:`forward` of one block that sees every key, for inference.

        The block's ``Q`` rows sit at cache rows ``n … n+Q-1``: their keys/values are
        written there (rows ``0 … n-1`` hold the context) and the block attends over rows
        ``0 … n+Q-1``, with no concatenated or head-expanded copies of the keys. The
        products run on :meth:`packed` weights (q/k/v as one, gate/up as one, each an
        ``x @ W`` in :func:`product_dtype`, with the residual added in the same BLAS call
        when the product runs in the rows' dtype); the same maths as
        :meth:`forward` with ``visible=None``, rounded differently, without autograd.

        x: [1, Q, H]; k_cache, v_cache: [1, kv_heads, >= n+Q, D]; cos/signed_sin:
        [1, Q, D], the tables of :meth:`Rotary.rolled`; ``weights``: this layer's
        :meth:`packed` weights when the caller just took them.
        """
        attn, w = self.self_attn, self.packed() if weights is None else weights
        heads, kv_heads, d = attn.num_heads, attn.num_kv_heads, attn.head_dim
        q_len, end = x.shape[1], n + x.shape[1]
        rows = x[0]  # [Q, H]
        norm = self.input_layernorm
        qkv = packed_product(normed(rows, norm.weight, norm.eps), w.qkv, w.qkv_bias)
        # queries and keys normed and rotated together: [1, heads + kv_heads, Q, D]
        qk = qkv[:, : (heads + kv_heads) * d].view(q_len, heads + kv_heads, d)
        qk = (normed(qk, None, w.eps) * w.qk_norm).transpose(0, 1)[None]
        qk = rotate_rolled(qk, cos, signed_sin)
        k_cache[:, :, n:end] = qk[:, heads:]
        v = qkv[:, (heads + kv_heads) * d :].view(q_len, kv_heads, d)
        v_cache[:, :, n:end] = v.transpose(0, 1)[None]
        with _backends(x):
            o = F.scaled_dot_product_attention(
                qk[:, :heads], k_cache[:, :, :end], v_cache[:, :, :end], scale=d**-0.5,
                enable_gqa=heads != kv_heads,
            )
        rows = packed_product(o[0].transpose(0, 1).reshape(q_len, heads * d), w.o, w.o_bias, rows)
        norm = self.post_attention_layernorm
        gate_up = packed_product(normed(rows, norm.weight, norm.eps), w.gate_up, None)
        inner = gate_up.shape[1] // 2
        act = F.silu(gate_up[:, :inner]) * gate_up[:, inner:]
        return packed_product(act, w.down, None, rows)[None]

    def context_keys_values(
        self,
        context: Tensor,
        cos: Tensor,
        signed_sin: Tensor,
        weights: PackedLayer | None = None,
    ) -> tuple[Tensor, Tensor]:
        """:meth:`DraftAttention.keys_values` of context rows ``[T, H]`` (cos/signed_sin
        [1, T, D], the tables of :meth:`Rotary.rolled`) on the :meth:`packed` weights
        (``weights`` when the caller just took them): rotated k, v ``[1, kv_heads, T, D]``."""
        attn, w = self.self_attn, self.packed() if weights is None else weights
        q_cols, d = attn.num_heads * attn.head_dim, attn.head_dim
        bias = None if w.qkv_bias is None else w.qkv_bias[q_cols:]
        kv = packed_product(context, w.kv, bias)  # [T, 2 kv_heads D]
        k, v = kv.view(kv.shape[0], 2 * attn.num_kv_heads, d).chunk(2, dim=1)
        k = normed(k, None, w.eps) * w.qk_norm[attn.num_heads :]
        return rotate_rolled(k.transpose(0, 1)[None], cos, signed_sin), v.transpose(0, 1)[None]

    def packed(self) -> PackedLayer:
        """This layer's weights laid out for :meth:`infer` in the :func:`product_dtype` set
        here, made again whenever that dtype differs or a parameter was changed or replaced
        since (its storage address or version counter moved).

        Parameters made under ``torch.inference_mode`` have no version counter: for them
        only a replaced parameter is noticed, not one written in place (a stale copy only
        changes the guesses, never the verified output)."""
        attn, mlp = self.self_attn, self.mlp
        packed_from = (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, attn.q_norm,
                       attn.k_norm, mlp.gate_proj, mlp.up_proj, mlp.down_proj)  # fmt: skip
        key = (_PRODUCTS.get(), *(
            (p.data_ptr(), -1 if p.is_inference() else p._version)
            for m in packed_from  # looked up each time: a replaced module is seen too
            for p in m._parameters.values()
            if p is not None
        ))
        if self._packed is None or self._packed_key != key:
            self._packed, self._packed_key = PackedLayer.of(self), key
        return self._packed


@dataclass(frozen=True)
class PackedLayer:
    """A :class:`DrafterLayer`'s weights as :meth:`DrafterLayer.infer` multiplies them:
    ``[in, out]`` row-major matrices (``x @ W``, which CPU BLAS runs faster than
    ``x @ weight.T`` on these skinny products), the q/k/v projections side by side, the
    gate and up projections side by side, and the per-head q/k norm weights as one
    ``[heads + kv_heads, D]`` table; the matrices in :func:`product_dtype` (biases and
    norm weights in the layer's dtype). Copies: training never sees them."""

    qkv: Tensor  # [H, (heads + 2 kv_heads) D]
    #: its k/v columns as a contiguous matrix of their own (the context's products): a
    #: column slice of ``qkv`` is strided, which CPU BLAS multiplies more slowly in some
    #: dtypes
    kv: Tensor  # [H, 2 kv_heads D]
    qkv_bias: Tensor | None
    qk_norm: Tensor  # [heads + kv_heads, D]
    o: Tensor  # [heads D, H]
    o_bias: Tensor | None
    gate_up: Tensor  # [H, 2 I]
    down: Tensor  # [I, H]
    eps: float

    @staticmethod
    @torch.no_grad()
    def of(layer: DrafterLayer) -> PackedLayer:
        attn, mlp = layer.self_attn, layer.mlp
        projections = (attn.q_proj, attn.k_proj, attn.v_proj)
        biases: list[Tensor] = [m.bias for m in projections if m.bias is not None]
        heads, kv_heads = attn.num_heads, attn.num_kv_heads

        def matrix(*weights: Tensor) -> Tensor:
            """``[in, out]``, contiguous, in :func:`product_dtype`."""
            w = torch.cat(weights).T
            return w.to(product_dtype(w)).contiguous()

        return PackedLayer(
            qkv=matrix(*(m.weight for m in projections)),
            kv=matrix(attn.k_proj.weight, attn.v_proj.weight),
            qkv_bias=torch.cat(biases) if len(biases) == 3 else None,
            qk_norm=torch.cat(
                [attn.q_norm.weight.expand(heads, -1), attn.k_norm.weight.expand(kv_heads, -1)]
            ),
            o=matrix(attn.o_proj.weight),
            o_bias=None if attn.o_proj.bias is None else attn.o_proj.bias.clone(),
            gate_up=matrix(mlp.gate_proj.weight, mlp.up_proj.weight),
            down=matrix(mlp.down_proj.weight),
            eps=attn.q_norm.eps,
        )


def packed_product(
    x: Tensor, w: Tensor, bias: Tensor | None, residual: Tensor | None = None
) -> Tensor:
    """``residual + x @ w + bias`` for 2-D ``x`` (each term optional), in ``x``'s dtype: in
    one BLAS call when ``w`` has that dtype and at most one of ``residual`` / ``bias`` is
    given; with ``w`` in another dtype (:func:`product_dtype`) the product runs in ``w``'s
    dtype and the sums in ``x``'s."""
    if w.dtype != x.dtype:
        y = torch.mm(x.to(w.dtype), w).to(x.dtype)
        if bias is not None:
            y = y + bias
        return y if residual is None else residual + y
    if bias is None:
        return torch.mm(x, w) if residual is None else torch.addmm(residual, x, w)
    return torch.addmm(bias if residual is None else residual + bias, x, w)


def _backends(x: Tensor) -> contextlib.AbstractContextManager[Any]:
    """The SDPA backend rule of :func:`attention_backends` where it changes anything: on a
    GPU, or on the math backend; on CPU SDPA otherwise chooses among the same kernels."""
    if x.device.type == "cpu" and not _MATH_ONLY.get():
        return contextlib.nullcontext()
    return sdpa_kernel(attention_backends())


def visibility(
    q_pos: Tensor,
    k_pos: Tensor,
    *,
    causal: bool,
    window: int | None,
) -> Tensor | None:
    """Which keys each query sees, from absolute positions (None: all of them).

    q_pos: [N, Q], k_pos: [N, K] → [N, Q, K] bool. Causal: key position <= query position.
    Window ``w``: query − key < w, and for a non-causal layer also key − query < w.
    """
    if not causal and window is None:
        return None
    dq = q_pos[:, :, None] - k_pos[:, None, :]  # [N, Q, K] query − key
    visible = torch.ones_like(dq, dtype=torch.bool)
    if causal:
        visible &= dq >= 0
    if window is not None:
        visible &= dq < window
        if not causal:
            visible &= -dq < window
    return visible
