"""Triton kernels: the gated delta rule over a long prompt in chunk-parallel (WY) form.

The maths (chunk recurrences, WY factors) is in :mod:`dflash.kernels.gdn_chunk_reference`.
Two launches:

1. :func:`gdn_chunk_wy_kernel`, one program per (chunk, batch x value head), all chunks in
   parallel: the chunk's ``A = tril(beta_i exp(G_i - G_j) k_i . k_j, -1)``, its inverse
   ``T = (I + A)^{-1}`` by forward substitution on a ``[C, C]`` register tile, then
   ``W = T diag(beta exp(G)) K`` and ``U0 = T diag(beta) V``, written to float32 scratch
   ``w [B, T, HV, K]`` and ``u [B, T, HV, V]``. Key and value dimensions are walked in
   blocks, so the tiles stay ``[C, <= 64]`` whatever ``K`` and ``V`` are.
2. :func:`gdn_chunk_state_kernel`, one program per (value block, batch x value head),
   walking the chunks in order with its ``[K, BV]`` float32 state tile in registers:
   ``U = U0 - W H``, ``O = diag(exp(G)) Q H + (Q K^T * D) U``,
   ``H <- exp(G_last) H + (diag(exp(G_last - G)) K)^T U``.

Why this layout: everything that does not depend on the state — the triangular solve,
the costly ``O(C^3 + C^2 (K + V))`` part — runs over all ``T / C`` chunks at once, so a
prompt fills the GPU even for one sequence; only products with the state remain in the
sequential pass, which keeps the state in float32 registers like the token kernel
(:mod:`dflash.kernels.gdn_triton`) and never writes a per-chunk state. Scratch is
``O(T (K + V) HV)`` float32; no ``[T, T]`` matrix exists. The cumulative decays ``G`` are
recomputed in both kernels (a ``cumsum`` of ``C`` values) rather than stored.

A partial last chunk is masked on load: its missing rows read ``k = v = g = beta = 0``, so
they add nothing (``A``, ``U0`` and ``W`` rows are zero and ``G`` stays at the last real
token's value). Both kernels use no atomics and fixed reduction orders: deterministic.
Each state program reads its state tile before it writes it, and writes only that tile,
so ``state`` may be any strided view (a slot of a pool) and is updated in place.

Products use ``tl.dot`` with ``input_precision="ieee"`` by default (float32 throughout);
``dot_precision="tf32"`` in the launcher trades accuracy for tensor-core speed.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit  # type: ignore[untyped-decorator]  # triton ships no types
def _rnorm(b_sq, USE_QK_L2NORM: tl.constexpr):  # type: ignore[no-untyped-def]  # Triton blocks are untyped
    """Per-row factors ``1 / sqrt(|x|^2 + 1e-6)`` from the squared norms ``b_sq`` (or ones)."""
    if USE_QK_L2NORM:  # noqa: SIM108 - a constexpr if, not an expression, for Triton
        b_r = 1.0 / tl.sqrt(b_sq + 1e-6)
    else:
        b_r = b_sq * 0.0 + 1.0
    return b_r


@triton.jit(do_not_specialize=["T"])  # type: ignore[untyped-decorator]  # triton ships no types
def gdn_chunk_wy_kernel(  # type: ignore[no-untyped-def]  # Triton pointers are untyped
    k, v, g, beta,                     # [B,T,HK,K], [B,T,HV,V], [B,T,HV] x2, contiguous
    w, u,                              # out: float32 [B,T,HV,K], [B,T,HV,V]
    T,
    HK: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, USE_QK_L2NORM: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    i_c = tl.program_id(0).to(tl.int64)
    i_bh = tl.program_id(1).to(tl.int64)
    i_b, i_hv = i_bh // HV, i_bh % HV
    i_hk = i_hv // (HV // HK)

    o_i = tl.arange(0, C)
    o_t = i_c * C + o_i                         # the chunk's token rows
    m_t = o_t < T
    b_g = tl.load(g + (i_b * T + o_t) * HV + i_hv, mask=m_t, other=0).to(tl.float32)
    b_beta = tl.load(beta + (i_b * T + o_t) * HV + i_hv, mask=m_t, other=0).to(tl.float32)
    b_G = tl.cumsum(b_g, 0)                     # cumulative log decay: [C]

    # the Gram matrix k_i . k_j and the squared norms, over key blocks
    NK: tl.constexpr = (K + BK - 1) // BK
    p_k = k + ((i_b * T + o_t[:, None]) * HK + i_hk) * K
    b_kk = tl.zeros([C, C], dtype=tl.float32)
    b_sq = tl.zeros([C], dtype=tl.float32)
    for i_k in range(NK):
        o_k = i_k * BK + tl.arange(0, BK)
        m_kb = m_t[:, None] & (o_k < K)[None, :]
        b_k = tl.load(p_k + o_k[None, :], mask=m_kb, other=0).to(tl.float32)
        b_kk += tl.dot(b_k, tl.trans(b_k), input_precision=DOT_PRECISION)
        b_sq += tl.sum(b_k * b_k, 1)
    b_rk = _rnorm(b_sq, USE_QK_L2NORM)          # key normalisation, per row

    # A[i, j] = beta_i exp(G_i - G_j) k_i . k_j for j < i: masked to -inf before the exp
    m_low = o_i[:, None] > o_i[None, :]
    b_D = tl.exp(tl.where(m_low, b_G[:, None] - b_G[None, :], float("-inf")))
    b_A = (b_beta * b_rk)[:, None] * b_kk * b_rk[None, :] * b_D

    # T = (I + A)^{-1} by forward substitution: row i = e_i - sum_{j<i} A[i, j] T[j, :]
    b_T = tl.where(o_i[:, None] == o_i[None, :], 1.0, 0.0)
    for i in range(1, C):
        m_row = o_i[:, None] == i
        b_a = tl.sum(tl.where(m_row, b_A, 0.0), 0)          # A[i, :], zero from i on
        b_T = tl.where(m_row, b_T - tl.sum(b_a[:, None] * b_T, 0)[None, :], b_T)

    # W = T diag(beta exp(G)) K (normalised keys), per key block
    b_wk = b_beta * tl.exp(b_G) * b_rk
    p_w = w + ((i_b * T + o_t[:, None]) * HV + i_hv) * K
    for i_k in range(NK):
        o_k = i_k * BK + tl.arange(0, BK)
        m_kb = m_t[:, None] & (o_k < K)[None, :]
        b_k = tl.load(p_k + o_k[None, :], mask=m_kb, other=0).to(tl.float32)
        b_w = tl.dot(b_T, b_k * b_wk[:, None], input_precision=DOT_PRECISION)
        tl.store(p_w + o_k[None, :], b_w, mask=m_kb)

    # U0 = T diag(beta) V, per value block
    NV: tl.constexpr = (V + BV - 1) // BV
    p_v = v + ((i_b * T + o_t[:, None]) * HV + i_hv) * V
    p_u = u + ((i_b * T + o_t[:, None]) * HV + i_hv) * V
    for i_v in range(NV):
        o_v = i_v * BV + tl.arange(0, BV)
        m_vb = m_t[:, None] & (o_v < V)[None, :]
        b_v = tl.load(p_v + o_v[None, :], mask=m_vb, other=0).to(tl.float32)
        b_u = tl.dot(b_T, b_v * b_beta[:, None], input_precision=DOT_PRECISION)
        tl.store(p_u + o_v[None, :], b_u, mask=m_vb)


@triton.jit(do_not_specialize=["T", "n_chunks"])  # type: ignore[untyped-decorator]  # triton ships no types
def gdn_chunk_state_kernel(  # type: ignore[no-untyped-def]  # Triton pointers are untyped
    q, k, g, w, u, o,                  # [B,T,HK,K] x2, [B,T,HV], w/u float32 scratch, o like v
    h,                                 # state [B,HV,K,V] float32, read then written, any strides
    scale, T, n_chunks,
    s_h_b, s_h_h, s_h_k, s_h_v,
    HK: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, USE_QK_L2NORM: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    i_v = tl.program_id(0).to(tl.int64)
    i_bh = tl.program_id(1).to(tl.int64)
    i_b, i_hv = i_bh // HV, i_bh % HV
    i_hk = i_hv // (HV // HK)

    o_i = tl.arange(0, C)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    m_h = m_k[:, None] & m_v[None, :]
    m_causal = o_i[:, None] >= o_i[None, :]

    p_h = h + i_b * s_h_b + i_hv * s_h_h + o_k[:, None] * s_h_k + o_v[None, :] * s_h_v
    b_h = tl.load(p_h, mask=m_h, other=0).to(tl.float32)   # the state before the chunk

    i_c = n_chunks * 0  # a scalar of the loop bound's type
    while i_c < n_chunks:  # a while loop: the interpreter cannot range() over a runtime bound
        o_t = i_c.to(tl.int64) * C + o_i
        m_t = o_t < T
        m_tk = m_t[:, None] & m_k[None, :]
        m_tv = m_t[:, None] & m_v[None, :]
        b_g = tl.load(g + (i_b * T + o_t) * HV + i_hv, mask=m_t, other=0).to(tl.float32)
        b_G = tl.cumsum(b_g, 0)                          # [C]
        # G_{C-1}: a partial chunk's padded rows add g = 0, so it is the last real token's G
        b_last = tl.sum(tl.where(o_i == C - 1, b_G, 0.0), 0)

        # U = U0 - W H: the chunk's u_i
        r_hv = (i_b * T + o_t[:, None]) * HV + i_hv
        b_w = tl.load(w + r_hv * K + o_k[None, :], mask=m_tk, other=0)
        b_u = tl.load(u + r_hv * V + o_v[None, :], mask=m_tv, other=0)
        b_u -= tl.dot(b_w, b_h, input_precision=DOT_PRECISION)

        r_hk = ((i_b * T + o_t[:, None]) * HK + i_hk) * K
        b_q = tl.load(q + r_hk + o_k[None, :], mask=m_tk, other=0).to(tl.float32)
        b_q *= (_rnorm(tl.sum(b_q * b_q, 1), USE_QK_L2NORM) * scale)[:, None]
        b_k = tl.load(k + r_hk + o_k[None, :], mask=m_tk, other=0).to(tl.float32)
        b_k *= _rnorm(tl.sum(b_k * b_k, 1), USE_QK_L2NORM)[:, None]

        # O = diag(exp(G)) Q H + (Q K^T * D) U, D masked to -inf above the diagonal first
        b_D = tl.exp(tl.where(m_causal, b_G[:, None] - b_G[None, :], float("-inf")))
        b_P = tl.dot(b_q, tl.trans(b_k), input_precision=DOT_PRECISION) * b_D
        b_o = tl.dot(b_q, b_h, input_precision=DOT_PRECISION) * tl.exp(b_G)[:, None]
        b_o += tl.dot(b_P, b_u, input_precision=DOT_PRECISION)
        p_o = o + ((i_b * T + o_t[:, None]) * HV + i_hv) * V + o_v[None, :]
        tl.store(p_o, b_o.to(p_o.dtype.element_ty), mask=m_tv)

        # H <- exp(G_last) H + (diag(exp(G_last - G)) K)^T U
        b_kd = b_k * tl.exp(b_last - b_G)[:, None]
        b_h = b_h * tl.exp(b_last) + tl.dot(tl.trans(b_kd), b_u, input_precision=DOT_PRECISION)
        i_c += 1

    tl.store(p_h, b_h, mask=m_h)


def default_config(K: int, V: int) -> tuple[int, int]:
    """(BV, num_warps) of the state pass for a ``[K, V]`` state: a ``[K, BV]`` float32
    tile and ``[C, K]`` query, key and W tiles live per program. Chosen for register room,
    not measured on a GPU."""
    BV = 32 if K <= 128 else 16
    return min(BV, max(16, triton.next_power_of_2(V))), 4 if K <= 64 else 8


def launch_gdn_chunk_prefill(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state: torch.Tensor, *, scale: float, use_qk_l2norm: bool, chunk: int,
    out: torch.Tensor | None = None, block_v: int | None = None, num_warps: int | None = None,
    dot_precision: str = "ieee",
) -> torch.Tensor:
    """Launch the two kernels on validated inputs (``state`` float32 ``[B, HV, K, V]``, any
    strides, updated in place; ``chunk`` a power of two in ``16 .. 128``);
    returns ``o`` in v's dtype, into ``out`` (contiguous ``[B, T, HV, V]``) when given."""
    B, T, HK, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    g, beta = g.contiguous(), beta.contiguous()
    o = torch.empty_like(v) if out is None else out
    w = torch.empty(B, T, HV, K, dtype=torch.float32, device=q.device)
    u = torch.empty(B, T, HV, V, dtype=torch.float32, device=q.device)
    n_chunks = triton.cdiv(T, chunk)
    BK = max(16, triton.next_power_of_2(K))
    block = 64 if chunk <= 64 else 32  # the WY kernel's key/value block
    gdn_chunk_wy_kernel[(n_chunks, B * HV)](
        k, v, g, beta, w, u, T,
        HK=HK, HV=HV, K=K, V=V, C=chunk, BK=min(BK, block),
        BV=min(max(16, triton.next_power_of_2(V)), block), USE_QK_L2NORM=use_qk_l2norm,
        DOT_PRECISION=dot_precision, num_warps=4 if chunk <= 64 else 8,
    )
    BV, warps = default_config(K, V)
    BV = block_v or BV
    gdn_chunk_state_kernel[(triton.cdiv(V, BV), B * HV)](
        q, k, g, w, u, o, state, scale, T, n_chunks, *state.stride(),
        HK=HK, HV=HV, K=K, V=V, C=chunk, BK=BK, BV=BV, USE_QK_L2NORM=use_qk_l2norm,
        DOT_PRECISION=dot_precision, num_warps=num_warps or warps,
    )
    return o
