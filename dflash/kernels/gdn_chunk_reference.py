"""The gated delta rule over a long prompt in chunk-parallel (WY / UT) form, in torch.

The token recurrence (:mod:`dflash.kernels.gdn_reference`), per value head, with the
state ``S`` of shape ``[K, V]``, normalised keys and scaled queries::

    S_t = exp(g_t) S_{t-1} + k_t u_t^T,    u_t = beta_t (v_t - exp(g_t) S_{t-1}^T k_t)
    o_t = S_t^T q_t

Cut the tokens into chunks of ``C`` (the last one may be shorter). Inside a chunk that
starts from the state ``H``, number its tokens ``i = 0 .. L-1`` and let
``G_i = g_0 + ... + g_i`` (cumulative log decay within the chunk). Unrolling the
recurrence gives ``S_i = exp(G_i) H + sum_{j <= i} exp(G_i - G_j) k_j u_j^T``, so

    u_i = beta_i (v_i - exp(G_i) H^T k_i - sum_{j < i} exp(G_i - G_j) (k_i . k_j) u_j).

With the strictly lower triangular ``A[i, j] = beta_i exp(G_i - G_j) (k_i . k_j)``
(``j < i``), the chunk's ``U = [u_0; ...; u_{L-1}]`` solves the unit lower triangular system
``(I + A) U = diag(beta) V - diag(beta exp(G)) K H``. Its inverse ``T = (I + A)^{-1}``
(forward substitution) gives the WY factors, which do not depend on ``H``::

    W  = T diag(beta exp(G)) K        [L, K]
    U0 = T diag(beta) V               [L, V]     (the chunk's pseudo-values)
    U  = U0 - W H                     [L, V]

and then the chunk's output (inter-chunk part through ``H``, intra-chunk causal part) and
the state after its last token::

    O  = diag(exp(G)) Q H + (Q K^T * D) U,     D[i, j] = exp(G_i - G_j) for i >= j, else 0
    H' = exp(G_{L-1}) H + (diag(exp(G_{L-1} - G)) K)^T U

Every decay is a difference of cumulative log decays taken only where it is needed: the
masked entries of ``D`` (``i < j``) are set to ``-inf`` *before* the exponential, so a
fast decay never overflows ``exp``. Per chunk the work is ``O(C^2 (K + V) + C K V)``
matrix products instead of ``C`` sequential rank-one updates. Memory: float32 copies of
the inputs per value head and ``o`` (``O(T (K + V) HV)``), plus one chunk's ``[C, C]``
matrices at a time: never ``T x T``.
"""

from __future__ import annotations

import torch

from dflash.kernels.gdn_reference import _l2norm  # the token loop's normalisation (eps 1e-6)


def gdn_chunk_prefill_reference(
    q: torch.Tensor,      # [B, T, HK, K]
    k: torch.Tensor,      # [B, T, HK, K]
    v: torch.Tensor,      # [B, T, HV, V]
    g: torch.Tensor,      # [B, T, HV] log decay
    beta: torch.Tensor,   # [B, T, HV]
    state: torch.Tensor,  # [B, HV, K, V] read, then overwritten with the final state
    *,
    scale: float | None = None,
    use_qk_l2norm: bool = True,
    chunk: int = 64,
    out: torch.Tensor | None = None,  # [B, T, HV, V] in v's dtype
) -> torch.Tensor:
    """Reference twin of :func:`dflash.kernels.gdn_chunk.gdn_chunk_prefill` (no bounds
    checks): the chunked form above, one chunk at a time, in float32 (float64 when
    ``q`` or ``state`` is float64). Returns ``o`` in v's dtype (``out`` when given)."""
    B, T, _, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    dt = torch.float64 if torch.float64 in (q.dtype, state.dtype) else torch.float32
    scale = K**-0.5 if scale is None else scale
    n = B * HV

    with torch.no_grad():  # like the kernels, the reference records nothing for autograd
        qf, kf = q.to(dt), k.to(dt)
        if use_qk_l2norm:
            qf, kf = _l2norm(qf), _l2norm(kf)
        qf = _by_head(qf * scale, HV)              # [n, T, K]
        kf = _by_head(kf, HV)                      # [n, T, K]
        vf = _by_head(v.to(dt), HV)                # [n, T, V]
        gf = g.to(dt).transpose(1, 2).reshape(n, T)     # [n, T]
        bf = beta.to(dt).transpose(1, 2).reshape(n, T)  # [n, T]
        h = state.to(dt).reshape(n, K, V)          # the state before the chunk: [n, K, V]
        o = torch.empty(B, T, HV, V, dtype=dt, device=q.device)
        causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()  # i >= j
        for c0 in range(0, T, chunk):
            c = slice(c0, min(c0 + chunk, T))
            o_c, h = _chunk(qf[:, c], kf[:, c], vf[:, c], gf[:, c], bf[:, c], h, causal)
            o[:, c] = o_c.view(B, HV, -1, V).transpose(1, 2)
        state.copy_(h.view(B, HV, K, V))
    if out is None:
        return o.to(v.dtype)
    out.copy_(o)
    return out


def _by_head(x: torch.Tensor, HV: int) -> torch.Tensor:
    """``x [B, T, H, D]`` as ``[B*HV, T, D]``, value head ``h`` taking head ``h // (HV // H)``."""
    B, T, H, D = x.shape
    return x.repeat_interleave(HV // H, dim=2).transpose(1, 2).reshape(B * HV, T, D)


def _chunk(
    q: torch.Tensor,     # [n, L, K] normalised and scaled
    k: torch.Tensor,     # [n, L, K] normalised
    v: torch.Tensor,     # [n, L, V]
    g: torch.Tensor,     # [n, L]
    beta: torch.Tensor,  # [n, L]
    h: torch.Tensor,     # [n, K, V] the state before the chunk
    causal: torch.Tensor,  # [C, C] bool, i >= j
) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk of ``L <= C`` tokens: returns ``(o [n, L, V], the state after it)``."""
    L = g.shape[1]
    G = g.cumsum(1)                                        # cumulative log decay: [n, L]
    # D[i, j] = exp(G_i - G_j) for i >= j; the other entries are -inf before the exp: 0
    D = (G[:, :, None] - G[:, None, :]).masked_fill(~causal[:L, :L], float("-inf")).exp()
    A = (beta[:, :, None] * (k @ k.mT) * D).tril(-1)       # strictly lower: [n, L, L]
    rhs = torch.cat((beta[:, :, None] * v, (beta * G.exp())[:, :, None] * k), dim=2)
    # unitriangular: the zero diagonal of A is read as ones, so this solves (I + A) X = rhs
    X = torch.linalg.solve_triangular(A, rhs, upper=False, unitriangular=True)
    U0, W = X.split([v.shape[2], k.shape[2]], dim=2)       # [n, L, V], [n, L, K]
    U = U0 - W @ h                                         # the chunk's u_i: [n, L, V]
    o = G.exp()[:, :, None] * (q @ h) + ((q @ k.mT) * D) @ U
    G_last = G[:, -1:]                                     # [n, 1]
    h = G_last.exp()[:, :, None] * h + (k * (G_last - G).exp()[:, :, None]).mT @ U
    return o, h
