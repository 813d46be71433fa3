"""The gated delta rule with checkpoint capture, as plain torch loops (the reference).

Per value head ``h`` (key head ``h // (HV // HK)``) and token ``t``, with the state
``S`` of shape ``[K, V]`` (flash-linear-attention's ``fused_recurrent_gated_delta_rule``):

    q_t, k_t <- q_t / sqrt(|q_t|^2 + 1e-6), k_t / sqrt(|k_t|^2 + 1e-6)   (if use_qk_l2norm)
    q_t      <- q_t * scale
    S        <- S * exp(g_t)
    u_t      =  beta_t * (v_t - S^T k_t)
    S        <- S + k_t u_t^T
    o_t      =  S^T q_t

Token ``t`` starts from the state after its parent token (a chain: token ``t-1``; token 0
and the root of a tree: ``initial_state``). Arithmetic runs in ``initial_state``'s dtype
(float32 in use, float64 when a test passes float64 states), one token at a time, so a
checkpoint equals the state reached by running the same tokens one call at a time.
"""

from __future__ import annotations

import torch

from dflash.kernels import checks


def gdn_verify_reference(
    q: torch.Tensor,             # [B, T, HK, K]
    k: torch.Tensor,             # [B, T, HK, K]
    v: torch.Tensor,             # [B, T, HV, V]
    g: torch.Tensor,             # [B, T, HV] log decay
    beta: torch.Tensor,          # [B, T, HV]
    initial_state: torch.Tensor, # [B, HV, K, V]
    checkpoints: torch.Tensor,   # [B, S, HV, K, V], S >= T
    geometry: object,
    *,
    scale: float | None = None,
    use_qk_l2norm: bool = True,
    final_state_only: bool = False,
    snapshot: torch.Tensor | None = None,  # [B, HV, K, V]
    out: torch.Tensor | None = None,       # [B, T, HV, V] in v's dtype
) -> torch.Tensor:
    """Reference twin of :func:`dflash.kernels.gdn_verify` (same arguments and effects)."""
    T, HK, K = q.shape[1:]
    HV = v.shape[2]
    parents = checks.geometry_parents(geometry, T, final_state_only)
    if parents is None:
        parents = tuple(range(-1, T - 1))
    dt = initial_state.dtype
    scale = K**-0.5 if scale is None else scale

    # Read the whole initial state before writing anything: it may alias a checkpoint slot.
    init = initial_state.to(dt).clone()
    if snapshot is not None:
        snapshot.copy_(init)

    qf, kf, vf = q.to(dt), k.to(dt), v.to(dt)
    gf, bf = g.to(dt), beta.to(dt)
    if use_qk_l2norm:
        qf = qf / torch.sqrt((qf * qf).sum(-1, keepdim=True) + 1e-6)
        kf = kf / torch.sqrt((kf * kf).sum(-1, keepdim=True) + 1e-6)
    qf = qf * scale
    group = HV // HK
    qf = qf.repeat_interleave(group, dim=2)  # [B, T, HV, K]
    kf = kf.repeat_interleave(group, dim=2)

    with torch.no_grad():  # like the kernel, the reference records nothing for autograd
        o, states = _recurrence(qf, kf, vf, gf, bf, init, parents)
    if final_state_only:
        checkpoints[:, 0] = states[:, -1]
    else:
        checkpoints[:, :T] = states
    if out is None:
        return o.to(v.dtype)
    out.copy_(o)
    return out


def _recurrence(
    qf: torch.Tensor,  # [B, T, HV, K], normalised and scaled
    kf: torch.Tensor,  # [B, T, HV, K], normalised
    vf: torch.Tensor,  # [B, T, HV, V]
    gf: torch.Tensor,  # [B, T, HV]
    bf: torch.Tensor,  # [B, T, HV]
    init: torch.Tensor,  # [B, HV, K, V]
    parents: tuple[int, ...],
) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-token state updates: ``o [B, T, HV, V]`` and the states after each token
    ``[B, T, HV, K, V]``, in ``init``'s dtype."""
    B, T, HV, K = kf.shape
    V = vf.shape[3]
    o = torch.empty(B, T, HV, V, dtype=init.dtype, device=init.device)
    # states[:, t]: the state after token t, computed in place (no per-token allocation)
    states = torch.empty(B, T, HV, K, V, dtype=init.dtype, device=init.device)
    # Every per-token operation below sees [B, HV, ...] tensors whatever T is, so a token's
    # state and output are the bits a T = 1 call gives for the same inputs.
    steps = zip(
        qf[:, :, :, None, :].unbind(1),  # [B, HV, 1, K] rows
        kf[:, :, :, None, :].unbind(1),
        kf[:, :, :, :, None].unbind(1),  # [B, HV, K, 1] columns
        vf[:, :, :, None, :].unbind(1),  # [B, HV, 1, V]
        gf.unbind(1),                    # [B, HV]
        bf[:, :, :, None, None].unbind(1),
        o[:, :, :, None, :].unbind(1),   # [B, HV, 1, V] views of o
        strict=True,
    )
    for t, (q_row, k_row, k_col, v_row, g_t, b_t, o_t) in enumerate(steps):
        S = states[:, t]
        torch.mul(init if parents[t] < 0 else states[:, parents[t]],
                  torch.exp(g_t)[:, :, None, None], out=S)
        kv = torch.matmul(k_row, S)                          # S^T k: [B, HV, 1, V]
        u = torch.sub(v_row, kv, out=kv).mul_(b_t)           # beta (v - S^T k)
        S.add_(k_col * u)                                    # S + k u^T
        torch.matmul(q_row, S, out=o_t)                      # S^T q
    return o, states
