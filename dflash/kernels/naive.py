"""Frozen naive oracles: the recurrent kernels' definitions, written as plainly as possible.

The CPU references beside each kernel (``*_reference.py``) are tuned — batched-matrix
views, checkpoint slots written in place, tile-shaped calls — because the CPU path decodes
with them; the Triton kernels are tuned for the GPU. Both are tested against these
functions, which are never tuned: one batch row, one head, one token at a time, in
float64, straight from the definitions. A change to a tuned path that changes what it
computes shows up as a disagreement with this file.

- :func:`gdn_naive`: the gated delta rule over a draft whose slot ``t`` starts from its
  parent's state (the root from the initial state); a chain is ``parents[t] = t - 1``.
- :func:`conv_naive`: the depthwise causal conv1d over the previous ``Kc-1`` inputs and
  the new ones, with its optional SiLU.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch


def gdn_naive(
    q: torch.Tensor,  # [B, T, HK, K]
    k: torch.Tensor,  # [B, T, HK, K]
    v: torch.Tensor,  # [B, T, HV, V]
    g: torch.Tensor,  # [B, T, HV] log decay
    beta: torch.Tensor,  # [B, T, HV]
    initial_state: torch.Tensor,  # [B, HV, K, V]
    parents: Sequence[int],  # parents[t]: the slot token t continues (-1: the initial state)
    *,
    scale: float | None = None,
    use_qk_l2norm: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(o [B, T, HV, V], states [B, T, HV, K, V])`` in float64: for every token ``t``
    and value head ``h`` (key head ``h // (HV / HK)``), from ``S`` = the parent's state::

        S <- exp(g_t) * S
        S <- S + k_t (beta_t * (v_t - S^T k_t))^T      (k_t, q_t unit length when l2-normed)
        o_t = S^T (scale * q_t)
    """
    B, T, HK, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    group = HV // HK
    scale = 1.0 / math.sqrt(K) if scale is None else scale
    f64 = torch.float64
    o = torch.zeros(B, T, HV, V, dtype=f64)
    states = torch.zeros(B, T, HV, K, V, dtype=f64)
    for b in range(B):
        for h in range(HV):
            for t in range(T):
                p = parents[t]
                S = (initial_state[b, h] if p < 0 else states[b, p, h]).to(f64).clone()
                qt = q[b, t, h // group].to(f64)
                kt = k[b, t, h // group].to(f64)
                if use_qk_l2norm:
                    qt = qt / math.sqrt(float((qt * qt).sum()) + 1e-6)
                    kt = kt / math.sqrt(float((kt * kt).sum()) + 1e-6)
                vt = v[b, t, h].to(f64)
                S = S * math.exp(float(g[b, t, h]))
                predicted = torch.zeros(V, dtype=f64)
                for i in range(K):
                    predicted += kt[i] * S[i]
                u = float(beta[b, t, h]) * (vt - predicted)
                for i in range(K):
                    S[i] += kt[i] * u
                out = torch.zeros(V, dtype=f64)
                for i in range(K):
                    out += scale * qt[i] * S[i]
                states[b, t, h] = S
                o[b, t, h] = out
    return o, states


def conv_naive(
    x: torch.Tensor,  # [B, T, C]
    conv_rows: torch.Tensor,  # [B, Kc-1, C], the previous inputs, oldest first
    weight: torch.Tensor,  # [C, Kc], weight[:, Kc-1] on the newest input
    bias: torch.Tensor | None,  # [C]
    *,
    activation: str | None = "silu",
) -> torch.Tensor:
    """``y [B, T, C]`` in float64: ``y[b, t, c] = act(bias[c] + sum_j weight[c, j] *
    xin[b, t + j, c])`` with ``xin = concat(conv_rows, x)`` along time."""
    B, T, C = x.shape
    Kc = weight.shape[1]
    f64 = torch.float64
    xin = torch.cat([conv_rows.to(f64), x.to(f64)], dim=1)
    y = torch.zeros(B, T, C, dtype=f64)
    for b in range(B):
        for t in range(T):
            for c in range(C):
                acc = 0.0 if bias is None else float(bias[c])
                for j in range(Kc):
                    acc += float(weight[c, j]) * float(xin[b, t + j, c])
                if activation == "silu":  # x * sigmoid(x), without overflowing exp
                    e = math.exp(-abs(acc))
                    acc = acc / (1.0 + e) if acc >= 0 else acc * e / (1.0 + e)
                y[b, t, c] = acc
    return y
