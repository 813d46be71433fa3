"""Triton kernel: one fused RMSNorm launch per call (optionally gated by ``silu(gate)``,
fed by a residual sum, or followed by the rotary embedding).

One program per row; the whole row (``D <= 8192``) is held in registers and reduced in
float32, so a row's result depends on that row alone — the same bits whatever the number
of rows in the call (M-invariance, which bitwise parity with plain greedy decoding relies on).
The torch formulation takes eight launches per norm; on a 32-layer target that is most of
a verify forward's launches. The two fused forms remove the launches around a norm:

- ``HAS_RES``: the row normalised is ``s = x + r`` rounded to the output dtype (the
  residual stream's add), and ``s`` is stored too;
- ``HAS_ROT``: after a zero-centred norm, the first ``R`` channels are rotated (rotate-half
  form) by the row's token's ``cos``/``sin``. Each product and the sum are rounded to the
  output dtype as the torch formulation's separate launches round them, so the result has
  the same bits as the norm followed by :func:`dflash.model.layers.apply_rotary` for
  16-bit models. ``x`` rows may be strided (a head's query inside ``[query | gate]``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit  # type: ignore[untyped-decorator]  # triton ships no types
def rounded(x, dt: tl.constexpr):  # type: ignore[no-untyped-def]  # Triton values are untyped
    """Float32 ``x`` rounded to ``dt`` (to nearest, ties to even) and widened back: the
    value a ``dt`` tensor would hold. bfloat16 is rounded on the bits (what the GPU's
    conversion does; Triton's CPU interpreter would truncate), so the interpreter's bits
    are the GPU's."""
    if dt == tl.bfloat16:
        b = x.to(tl.uint32, bitcast=True)
        b = (b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000
        return tl.where(x != x, x, b.to(tl.float32, bitcast=True))  # a NaN stays one
    elif dt == tl.float32:
        return x
    else:
        return x.to(dt).to(tl.float32)


@triton.jit  # type: ignore[untyped-decorator]  # triton ships no types
def rms_norm_kernel(  # type: ignore[no-untyped-def]  # Triton pointers are untyped
    x, w, z, y, r, s, cs, sn,  # x, z: rows of strides sx, sz; y, r, s: [R, D]; w: [D]
    sx, sz, eps, D, H, T, RD,  # cs, sn: [T, RD]; a row's token is (row // H) % T
    ZERO_CENTRED: tl.constexpr, HAS_GATE: tl.constexpr, HAS_RES: tl.constexpr,
    HAS_ROT: tl.constexpr, BD: tl.constexpr,
):
    i_r = tl.program_id(0).to(tl.int64)
    o_d = tl.arange(0, BD)
    m_d = o_d < D
    dt = y.dtype.element_ty
    b_x = tl.load(x + i_r * sx + o_d, mask=m_d, other=0).to(tl.float32)
    if HAS_RES:  # the residual stream's add, rounded as a separate add would round it
        b_x = rounded(b_x + tl.load(r + i_r * D + o_d, mask=m_d, other=0).to(tl.float32), dt)
        tl.store(s + i_r * D + o_d, b_x.to(dt), mask=m_d)
    b_w = tl.load(w + o_d, mask=m_d, other=0)
    inv = tl.rsqrt(tl.sum(b_x * b_x) / D + eps)
    b_n = b_x * inv
    if ZERO_CENTRED:
        b_y = b_n * (1.0 + b_w.to(tl.float32))
    else:
        # weight * normed, with normed rounded to the output dtype first (as the reference)
        b_y = rounded(b_w.to(tl.float32) * rounded(b_n, dt), dt)
    if HAS_GATE:
        b_z = tl.load(z + i_r * sz + o_d, mask=m_d, other=0).to(tl.float32)
        b_y = b_y * (b_z * tl.sigmoid(b_z))
    if HAS_ROT:
        # rotate-half on the first RD channels: channel c < RD/2 pairs with c + RD/2 (its
        # partner, negated), c >= RD/2 with c - RD/2. The partner's normed value is
        # recomputed from its input with the row's scale: the same bits as b_y's
        half = RD // 2
        in_rot = o_d < RD
        o_p = tl.where(o_d < half, o_d + half, o_d - half)
        b_xp = tl.load(x + i_r * sx + o_p, mask=in_rot, other=0).to(tl.float32)
        b_wp = tl.load(w + o_p, mask=in_rot, other=0).to(tl.float32)
        b_yp = rounded((b_xp * inv) * (1.0 + b_wp), dt)
        b_yp = tl.where(o_d < half, -b_yp, b_yp)
        tok = (i_r // H) % T
        b_c = tl.load(cs + tok * RD + o_d, mask=in_rot, other=0).to(tl.float32)
        b_sn = tl.load(sn + tok * RD + o_d, mask=in_rot, other=0).to(tl.float32)
        b_r = rounded(b_y, dt)
        turned = rounded(rounded(b_r * b_c, dt) + rounded(b_yp * b_sn, dt), dt)
        b_y = tl.where(in_rot, turned, b_r)
    tl.store(y + i_r * D + o_d, rounded(b_y, dt).to(dt), mask=m_d)


def launch_rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centred: bool,
    gate: torch.Tensor | None, *, out: torch.Tensor | None = None,
    residual: torch.Tensor | None = None, sum_out: torch.Tensor | None = None,
    rotary: tuple[torch.Tensor, torch.Tensor, int] | None = None,
) -> torch.Tensor:
    """Launch :func:`rms_norm_kernel` on validated inputs; returns ``y`` like ``x``.

    ``out`` (validated: contiguous, shaped and typed like ``x``) receives ``y``; ``None``
    allocates it. ``residual`` (contiguous, like ``x``) with ``sum_out`` (contiguous, like
    ``x``): ``x + residual`` is normalised and lands in ``sum_out``. ``rotary = (cos, sin,
    heads)``: ``x`` is ``[..., T, heads, D]`` rows (last dimension contiguous, leading
    ones collapsible into one row stride), ``cos``/``sin`` contiguous ``[T, RD]``.
    """
    D = x.shape[-1]
    # a head's rows may be strided: read in place
    x2 = as_rows(x) if rotary is not None else x.reshape(-1, D).contiguous()
    z2 = None if gate is None else as_rows(gate)  # a column slice of the projection, in place
    y = torch.empty(x2.shape, dtype=x.dtype, device=x.device) if out is None else out.view(-1, D)
    r2 = None if residual is None else residual.reshape(-1, D)
    s2 = None if sum_out is None else sum_out.view(-1, D)
    rows = x2.shape[0]
    cos, sin, heads = rotary if rotary is not None else (x2, x2, 1)
    T, RD = (cos.shape[0], cos.shape[1]) if rotary is not None else (1, 0)
    if rows:
        BD = triton.next_power_of_2(D)
        rms_norm_kernel[(rows,)](
            x2, weight.contiguous(), x2 if z2 is None else z2, y,
            x2 if r2 is None else r2, y if s2 is None else s2, cos, sin,
            x2.stride(0), D if z2 is None else z2.stride(0), eps, D, heads, T, RD,
            ZERO_CENTRED=zero_centred, HAS_GATE=z2 is not None, HAS_RES=r2 is not None,
            HAS_ROT=rotary is not None, BD=BD,
            num_warps=4 if BD <= 1024 else 8,
        )
    return y.view(x.shape) if out is None else out


def as_rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` as ``[R, D]`` rows of unit column stride: a view when its leading dimensions
    collapse into one row stride, else a contiguous copy."""
    D = x.shape[-1]
    if x.stride(-1) == 1 or D == 1:
        try:
            return x.view(-1, D)
        except RuntimeError:
            pass
    return x.reshape(-1, D).contiguous()
