"""The gated delta rule with checkpoint capture, and its recompute, as plain torch loops
(the reference).

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
:func:`gdn_recompute_reference` re-runs the first ``n`` tokens of a verify from the
pre-verify state with the same per-token operations (a ``recompute`` rollback).
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
    checkpoints: torch.Tensor | None,  # [B, S, HV, K, V], S >= T; None: no states kept
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
        qf, kf = _l2norm(qf), _l2norm(kf)
    qf = qf * scale
    group = HV // HK
    qf = qf.repeat_interleave(group, dim=2)  # [B, T, HV, K]
    kf = kf.repeat_interleave(group, dim=2)

    with torch.no_grad():  # like the kernel, the reference records nothing for autograd
        if checkpoints is None:  # the states are computed in scratch and dropped
            slots = _scratch(T, q.shape[0] * HV, K, vf.shape[3], dt, init.device)
            return _output(_recurrence(qf, kf, vf, gf, bf, init, parents, slots), v, out)
        slots, in_place = _state_slots(checkpoints, T, final_state_only, dt)
        o = _recurrence(qf, kf, vf, gf, bf, init, parents, slots)
        if not in_place:  # computed in scratch: copy the states out
            if final_state_only:
                checkpoints[:, 0] = slots[-1].view(init.shape)
            else:
                checkpoints[:, :T] = torch.stack(slots).view(T, *init.shape).transpose(0, 1)
    return _output(o, v, out)


def gdn_recompute_reference(
    state: torch.Tensor,      # [L, B, HV, K, V] the pre-verify states
    inputs: torch.Tensor,     # [L, B, S, C] q | k | v per token, C = 2*HK*K + HV*V
    g: torch.Tensor,          # [L, B, S, HV] log decay
    beta: torch.Tensor,       # [L, B, S, HV]
    conv_rows: torch.Tensor,  # [L, B, Kc-1, C] out
    captured: torch.Tensor,   # [L, B, Kc-1+S, C]
    commit_n: int | torch.Tensor,
    *,
    out: torch.Tensor | None = None,       # [L, B, HV, K, V]; None: ``state`` in place
    snapshot: torch.Tensor | None = None,  # [L, B, HV, K, V]
    path: torch.Tensor | None = None,      # [P] int64 rows of the tokens; None: 0 .. n-1
    use_qk_l2norm: bool = True,
) -> None:
    """Reference twin of :func:`dflash.kernels.gdn_recompute` (no bounds checks; a tensor
    ``commit_n`` and ``path`` are read here and clamped like the kernel clamps them:
    ``commit_n`` to ``1 .. min(S, P)``, each row to ``0 .. S-1``).

    Each layer runs :func:`gdn_verify_reference`'s per-token operations on the same
    ``[B*HV, ...]`` shapes, in ``state``'s dtype, so the state it reaches is that
    reference's checkpoint slot ``n-1`` for the same inputs, bit for bit.
    """
    L, B, HV, K, V = state.shape
    S, C = inputs.shape[2], inputs.shape[3]
    HK = (C - HV * V) // (2 * K)
    n_max = S if path is None else min(S, path.shape[0])
    n = commit_n if isinstance(commit_n, int) else min(max(int(commit_n.reshape(())), 1), n_max)
    rows = list(range(n)) if path is None else [min(max(r, 0), S - 1) for r in path[:n].tolist()]
    kc1 = conv_rows.shape[2]
    # the window after n tokens: entries n .. n+Kc-2 of (pre-verify window, the rows' inputs)
    window = [e if e < kc1 else kc1 + rows[e - kc1] for e in range(n, n + kc1)]
    index = torch.tensor(rows, dtype=torch.int64, device=inputs.device)
    dt = state.dtype
    target = state if out is None else out
    with torch.no_grad():
        for l in range(L):
            init = state[l].clone()  # read the whole state before writing: out may be state
            if snapshot is not None:
                snapshot[l].copy_(init)
            x = inputs[l].index_select(1, index)  # [B, n, C]
            kf = x[..., HK * K : 2 * HK * K].reshape(B, n, HK, K).to(dt)
            vf = x[..., 2 * HK * K :].reshape(B, n, HV, V).to(dt)
            if use_qk_l2norm:
                kf = _l2norm(kf)
            kf = kf.repeat_interleave(HV // HK, dim=2)  # [B, n, HV, K]
            slots = _scratch(n, B * HV, K, V, dt, init.device)
            prev = init.reshape(B * HV, K, V)
            steps = zip(
                _tokens(kf, 1, K), _tokens(kf, K, 1), _tokens(vf, 1, V),
                _tokens(g[l].index_select(1, index).to(dt), 1, 1),
                _tokens(beta[l].index_select(1, index).to(dt), 1, 1), slots,
                strict=True,
            )
            for k_row, k_col, v_row, g_t, b_t, S_t in steps:
                _step(prev, k_row, k_col, v_row, g_t, b_t, S_t)
                prev = S_t
            target[l].copy_(prev.view(B, HV, K, V))
        conv_rows.copy_(captured.index_select(2, torch.tensor(window, device=captured.device)))


def _output(o: torch.Tensor, v: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """``o`` in v's dtype: into ``out`` when given, else a new tensor."""
    if out is None:
        return o.to(v.dtype)
    out.copy_(o)
    return out


def _scratch(
    rows: int, n: int, K: int, V: int, dt: torch.dtype, device: torch.device
) -> list[torch.Tensor]:
    """``rows`` contiguous ``[n, K, V]`` scratch states."""
    if rows == 0:
        return []
    return list(torch.empty(rows, n, K, V, dtype=dt, device=device).unbind(0))


def _state_slots(
    checkpoints: torch.Tensor, T: int, final_state_only: bool, dt: torch.dtype
) -> tuple[list[torch.Tensor], bool]:
    """Where the state after each token is computed: ``T`` contiguous ``[B*HV, K, V]``
    tensors, and whether they are the checkpoint slots themselves.

    They are when the slots can be viewed so (``B = 1``, slots contiguous and in ``dt``);
    with ``final_state_only`` only the last token's state goes to slot 0 and the others
    to scratch. Otherwise every state goes to scratch, for the caller to copy out."""
    B, _, HV, K, V = checkpoints.shape
    slot = checkpoints[0]  # [S, HV, K, V]
    in_place = B == 1 and checkpoints.dtype == dt and all(
        slot[t].is_contiguous() for t in range(1 if final_state_only else T)
    )
    if in_place and not final_state_only:
        return [slot[t].view(HV, K, V) for t in range(T)], True
    rows = T - 1 if in_place else T  # a decode's one state needs no scratch at all
    scratch = _scratch(rows, B * HV, K, V, dt, checkpoints.device)
    if in_place:
        scratch.append(slot[0].view(HV, K, V))
    return scratch, in_place


def _recurrence(
    qf: torch.Tensor,  # [B, T, HV, K], normalised and scaled
    kf: torch.Tensor,  # [B, T, HV, K], normalised
    vf: torch.Tensor,  # [B, T, HV, V]
    gf: torch.Tensor,  # [B, T, HV]
    bf: torch.Tensor,  # [B, T, HV]
    init: torch.Tensor,  # [B, HV, K, V]
    parents: tuple[int, ...],
    slots: list[torch.Tensor],  # T x [B*HV, K, V]: where the state after token t goes
) -> torch.Tensor:
    """The per-token state updates: writes the state after token ``t`` into ``slots[t]``
    and returns ``o [B, T, HV, V]``, in ``init``'s dtype."""
    B, T, HV, K = kf.shape
    V = vf.shape[3]
    n = B * HV
    o = torch.empty(T, n, 1, V, dtype=init.dtype, device=init.device)

    # Every per-token operation below sees [B*HV, ...] tensors whatever T is, so a token's
    # state and output are the bits a T = 1 call gives for the same inputs.
    steps = zip(
        _tokens(qf, 1, K), _tokens(kf, 1, K), _tokens(kf, K, 1), _tokens(vf, 1, V),
        _tokens(gf, 1, 1), _tokens(bf, 1, 1), slots, o.unbind(0),
        strict=True,
    )
    start = init.reshape(n, K, V)
    for t, (q_row, k_row, k_col, v_row, g_t, b_t, S, o_t) in enumerate(steps):
        _step(start if parents[t] < 0 else slots[parents[t]], k_row, k_col, v_row, g_t, b_t, S)
        torch.bmm(q_row, S, out=o_t)                         # S^T q
    out = o.view(T, B, HV, V).transpose(0, 1)
    return out if B == 1 else out.contiguous()


def _tokens(x: torch.Tensor, *shape: int) -> tuple[torch.Tensor, ...]:
    """``x [B, T, HV, ...]`` as ``T`` tensors ``[B*HV, *shape]``, one per token."""
    B, T, HV = x.shape[:3]
    return x.transpose(0, 1).reshape(T, B * HV, *shape).unbind(0)


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    """``x / sqrt(|x|^2 + 1e-6)`` along the last dimension."""
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def _step(
    prev: torch.Tensor,   # [n, K, V] the state before the token
    k_row: torch.Tensor,  # [n, 1, K] normalised key
    k_col: torch.Tensor,  # [n, K, 1] the same key
    v_row: torch.Tensor,  # [n, 1, V]
    g_t: torch.Tensor,    # [n, 1, 1]
    b_t: torch.Tensor,    # [n, 1, 1]
    S: torch.Tensor,      # [n, K, V] receives the state after the token (may not be prev)
) -> None:
    """One token of the gated delta rule for ``n = B*HV`` heads (verify and recompute)."""
    torch.mul(prev, torch.exp(g_t), out=S)
    kv = torch.bmm(k_row, S)                                 # S^T k: [n, 1, V]
    u = torch.sub(v_row, kv, out=kv).mul_(b_t)               # beta (v - S^T k)
    S.baddbmm_(k_col, u)                                     # S + k u^T
