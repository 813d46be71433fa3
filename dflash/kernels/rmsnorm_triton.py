"""Triton kernel: one fused RMSNorm launch per call (optionally gated by ``silu(gate)``).

One program per row; the whole row (``D <= 8192``) is held in registers and reduced in
float32, so a row's result depends on that row alone — the same bits whatever the number
of rows in the call (M-invariance, which bitwise parity with plain greedy decoding relies on).
The torch formulation takes eight launches per norm; on a 32-layer target that is most of
a verify forward's launches.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit  # type: ignore[untyped-decorator]  # triton ships no types
def rms_norm_kernel(  # type: ignore[no-untyped-def]  # Triton pointers are untyped
    x, w, z, y,                # x, z (gate), y: [R, D] row-major; w: [D]
    eps, D,
    ZERO_CENTRED: tl.constexpr, HAS_GATE: tl.constexpr, BD: tl.constexpr,
):
    i_r = tl.program_id(0).to(tl.int64)
    o_d = tl.arange(0, BD)
    m_d = o_d < D
    b_x = tl.load(x + i_r * D + o_d, mask=m_d, other=0).to(tl.float32)
    b_w = tl.load(w + o_d, mask=m_d, other=0)
    b_n = b_x * tl.rsqrt(tl.sum(b_x * b_x) / D + eps)
    if ZERO_CENTRED:
        b_y = b_n * (1.0 + b_w.to(tl.float32))
    else:
        # weight * normed, with normed rounded to the output dtype first (as the reference)
        b_y = b_w.to(tl.float32) * b_n.to(y.dtype.element_ty).to(tl.float32)
        b_y = b_y.to(y.dtype.element_ty).to(tl.float32)
    if HAS_GATE:
        b_z = tl.load(z + i_r * D + o_d, mask=m_d, other=0).to(tl.float32)
        b_y = b_y * (b_z * tl.sigmoid(b_z))
    tl.store(y + i_r * D + o_d, b_y.to(y.dtype.element_ty), mask=m_d)


def launch_rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centred: bool,
    gate: torch.Tensor | None, *, out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Launch :func:`rms_norm_kernel` on validated inputs; returns ``y`` like ``x``.

    ``out`` (validated: contiguous, shaped and typed like ``x``) receives ``y``; ``None``
    allocates it.
    """
    D = x.shape[-1]
    x2 = x.reshape(-1, D).contiguous()
    z2 = None if gate is None else gate.reshape(-1, D).contiguous()
    y = torch.empty_like(x2) if out is None else out.view(-1, D)
    rows = x2.shape[0]
    if rows:
        BD = triton.next_power_of_2(D)
        rms_norm_kernel[(rows,)](
            x2, weight.contiguous(), x2 if z2 is None else z2, y, eps, D,
            ZERO_CENTRED=zero_centred, HAS_GATE=z2 is not None, BD=BD,
            num_warps=4 if BD <= 1024 else 8,
        )
    return y.view(x.shape) if out is None else out
