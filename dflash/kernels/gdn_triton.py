"""Triton kernel: gated delta rule over T tokens, writing an F32 checkpoint per token.

One program per (value-block, batch x value-head); the whole key dimension (K <= 256)
is held in registers, so the ``[K, BV]`` state tile stays in float32 registers across all
tokens. ``T``, the slot step, the snapshot flag and the tree flag are runtime arguments
(``do_not_specialize``), so verification, prefill, decode and replay run the *same*
binary: a checkpoint written during verification is bit-identical to the state reached
by decoding the same tokens one call at a time.

Alias safety: a program reads its whole initial tile, then passes a CTA barrier, before it
writes anything; it only ever writes its own tile, so ``initial_state`` may be a slot of
``checkpoints`` (slot remap) or ``checkpoints`` may be ``initial_state.unsqueeze(1)``
(in-place decode). Tree mode reloads a parent slot this same program wrote earlier, after
a barrier, so it is race-free. Slot step -1 stores no state (a verify whose rollback
recomputes), except, in a tree, the states of the nodes a later child starts from: they
go to scratch slots (``tree_states``) and are reloaded by those children.

:func:`gdn_recompute_kernel` re-runs the recurrence of a verify's first ``n`` tokens from
the pre-verify state, for every layer of a shard in one launch, with the verify's tile
shape, warps and per-token helper (:func:`_gated_delta_step`): the state it reaches is the
verify's checkpoint slot ``n-1``, bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dflash.kernels.tree_paths import tree_table_values

_DUMMY_PARENTS: dict[torch.device, torch.Tensor] = {}
_NO_SLOT: dict[torch.device, torch.Tensor] = {}  # int64 [1] = -1: the initial state is h0


def _constant(cache: dict[torch.device, torch.Tensor], device: torch.device,
              dtype: torch.dtype) -> torch.Tensor:
    """A one-element tensor holding -1 on ``device`` (made once per device)."""
    got = cache.get(device)
    if got is None:
        got = cache.setdefault(device, torch.full((1,), -1, dtype=dtype, device=device))
    return got


@triton.jit  # type: ignore[untyped-decorator]  # triton ships no types
def _l2norm(b_x, USE_QK_L2NORM: tl.constexpr):  # type: ignore[no-untyped-def]  # Triton blocks are untyped
    """``b_x / sqrt(|b_x|^2 + 1e-6)`` over a q or k head block (masked lanes hold 0), if enabled."""
    if USE_QK_L2NORM:
        b_x = b_x / tl.sqrt(tl.sum(b_x * b_x) + 1e-6)
    return b_x


@triton.jit
def _gated_delta_step(b_h, b_k, b_v, b_g, b_beta):  # type: ignore[no-untyped-def]  # Triton blocks are untyped
    """One token of the gated delta rule on a ``[BK, BV]`` float32 state tile.

    ``b_k`` (``[BK]``, normalised by :func:`_l2norm`), ``b_v`` (``[BV]``), ``b_g``,
    ``b_beta`` (scalars) are float32. Returns the new tile. :func:`gdn_verify_kernel` and
    :func:`gdn_recompute_kernel` both call it, so a recomputed state is the same
    arithmetic, bit for bit, as a verify's checkpoint (same block sizes and warps).
    """
    b_h *= tl.exp(b_g)
    b_u = b_beta * (b_v - tl.sum(b_h * b_k[:, None], 0))   # beta (v - S^T k): [BV]
    b_h += b_k[:, None] * b_u[None, :]
    return b_h


@triton.jit  # type: ignore[untyped-decorator]  # triton ships no types
def _slot_inputs(  # type: ignore[no-untyped-def]  # Triton values are untyped
    q, k, v, g, beta, i_base_k, i_base_v, i_base_g, s, o_k, o_v,
    HK: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
):
    """Slot ``s``'s q, k (``[BK]``), v (``[BV]``), g and beta, as float32; nothing past a
    walk's end (``s < 0``: masked loads, zeros). The masks compare full blocks (a block
    ``&`` a scalar is not a boolean mask for every triton interpreter)."""
    at = tl.maximum(s, 0).to(tl.int64)
    m_k = o_k < tl.where(s >= 0, K, 0)
    m_v = o_v < tl.where(s >= 0, V, 0)
    b_q = tl.load(q + i_base_k + at * (HK * K) + o_k, mask=m_k, other=0).to(tl.float32)
    b_k = tl.load(k + i_base_k + at * (HK * K) + o_k, mask=m_k, other=0).to(tl.float32)
    b_v = tl.load(v + i_base_v + at * (HV * V) + o_v, mask=m_v, other=0).to(tl.float32)
    b_g = tl.load(g + i_base_g + at * HV, mask=s >= 0, other=0).to(tl.float32)
    b_beta = tl.load(beta + i_base_g + at * HV, mask=s >= 0, other=0).to(tl.float32)
    return b_q, b_k, b_v, b_g, b_beta


@triton.jit(do_not_specialize=["T", "slot_step", "has_snapshot", "is_tree", "bank_slots",
                              "walk_base"])  # type: ignore[untyped-decorator]  # triton ships no types
def gdn_verify_kernel(  # type: ignore[no-untyped-def]  # Triton pointers are untyped
    q, k, v, g, beta, o,               # inputs [B,T,HK,K] x2, [B,T,HV,V], [B,T,HV] x2; o like v
    h0, ckpt, snap, parents,           # state [B,HV,K,V], slots [B,S,HV,K,V], snapshot, int32 [T]
    bank, live,                        # slots [B,S',HV,K,V] read when *live >= 0; int64 [1]
    scale, T, slot_step, has_snapshot, is_tree, bank_slots, walk_base,
    s_h0_b, s_h0_h, s_h0_k, s_h0_v,
    s_bk_b, s_bk_s, s_bk_h, s_bk_k, s_bk_v,
    s_ck_b, s_ck_s, s_ck_h, s_ck_k, s_ck_v,
    s_sn_b, s_sn_h, s_sn_k, s_sn_v,
    HK: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, USE_QK_L2NORM: tl.constexpr,
    STORE_HINT: tl.constexpr = 0,      # slot stores: 0 plain, 1 streaming (.cs), 2 evict_first
    READ_LIVE: tl.constexpr = 0,       # 1: the initial state may be a bank slot (``*live``)
):
    i_v = tl.program_id(0).to(tl.int64)
    i_bh = tl.program_id(1).to(tl.int64)
    i_b, i_hv = i_bh // HV, i_bh % HV
    i_hk = i_hv // (HV // HK)

    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    m_h = m_k[:, None] & m_v[None, :]

    # the state tile [BK, BV]: one pointer grid per storage
    p_h0 = h0 + i_b * s_h0_b + i_hv * s_h0_h + o_k[:, None] * s_h0_k + o_v[None, :] * s_h0_v
    o_ck = i_b * s_ck_b + i_hv * s_ck_h + o_k[:, None] * s_ck_k + o_v[None, :] * s_ck_v

    # this program's walk: a chain walks slots 0 … T-1; a tree walks row ``walk_base +
    # program_id(2)`` of the walks table (slots, then -1; an empty row walks nothing)
    p_walk = parents + 2 * T + (walk_base + tl.program_id(2)) * T   # read by trees only
    s = T * 0
    if is_tree != 0:
        s = tl.load(p_walk)
    i_base_k = (i_b * T * HK + i_hk) * K
    i_base_v = (i_b * T * HV + i_hv) * V
    i_base_g = i_b * T * HV + i_hv

    # the live slot (slot remap) is issued first: its latency overlaps the first token's
    # loads below instead of delaying the state tile
    if READ_LIVE:
        live_slot = tl.load(live)
    # slot s's inputs are loaded during the previous slot (a hand-written one-deep
    # pipeline)
    b_q, b_k, b_v, b_g, b_beta = _slot_inputs(
        q, k, v, g, beta, i_base_k, i_base_v, i_base_g, s, o_k, o_v, HK, HV, K, V)
    if READ_LIVE:  # slot >= 0: the live state is bank[:, slot] (clamped: stays in bounds)
        slot = tl.minimum(live_slot, bank_slots - 1)
        p_bk = (bank + i_b * s_bk_b + tl.maximum(slot, 0) * s_bk_s + i_hv * s_bk_h
                + o_k[:, None] * s_bk_k + o_v[None, :] * s_bk_v)
        b_h = tl.load(tl.where(slot >= 0, p_bk, p_h0), mask=m_h, other=0).to(tl.float32)
    else:
        b_h = tl.load(p_h0, mask=m_h, other=0).to(tl.float32)
    if has_snapshot != 0:
        p_sn = snap + i_b * s_sn_b + i_hv * s_sn_h + o_k[:, None] * s_sn_k + o_v[None, :] * s_sn_v
        tl.store(p_sn, b_h, mask=m_h)
    # every read of the initial tile happens before any write of a slot (alias safety)
    tl.debug_barrier()

    i = T * 0      # entries of the walk done (int32 scalars, like the loop bound)
    prev = i - 1   # the slot walked last (the root's parent, -1, before the first)
    while s >= 0:  # a while loop: the interpreter cannot range() over a runtime bound
        if is_tree != 0:
            parent = tl.load(parents + s)
            if parent != prev:
                # the parent's slot was written earlier: by this program, or (a subtree's
                # first node) by the trunk's launch, which ran first
                tl.debug_barrier()
                b_h = tl.load(ckpt + parent.to(tl.int64) * s_ck_s + o_ck, mask=m_h, other=0)
        b_q = _l2norm(b_q, USE_QK_L2NORM)
        b_k = _l2norm(b_k, USE_QK_L2NORM)
        b_q = b_q * scale
        b_h = _gated_delta_step(b_h, b_k, b_v, b_g, b_beta)
        b_o = tl.sum(b_h * b_q[:, None], 0)                    # S^T q: [BV]
        p_o = o + i_base_v + s.to(tl.int64) * (HV * V) + o_v
        tl.store(p_o, b_o.to(p_o.dtype.element_ty), mask=m_v)

        # slot_step 1: slot s after every token; 0: slot 0 after the last token; -1: none,
        # but in a tree the nodes flagged in parents[T + s] (a node that does not follow
        # them in its walk starts from their state) keep it in their slot of ``ckpt``
        keep = (slot_step > 0) | ((slot_step == 0) & (s == T - 1))
        if (slot_step < 0) & (is_tree != 0):
            keep = tl.load(parents + T + s) != 0
        if keep:
            # the last token's state goes to slot 0 (a name of its own: Triton merges
            # same-named values across branches, and ``slot`` above is int64)
            at = tl.where(slot_step == 0, 0, s)
            p_slot = ckpt + at.to(tl.int64) * s_ck_s + o_ck
            if STORE_HINT == 1:
                tl.store(p_slot, b_h, mask=m_h, cache_modifier=".cs")
            elif STORE_HINT == 2:
                tl.store(p_slot, b_h, mask=m_h, eviction_policy="evict_first")
            else:
                tl.store(p_slot, b_h, mask=m_h)

        prev = s
        i += 1
        s = tl.where(i < T, i, -1)
        if is_tree != 0:
            s = tl.load(p_walk + i, mask=i < T, other=-1)
        b_q, b_k, b_v, b_g, b_beta = _slot_inputs(
            q, k, v, g, beta, i_base_k, i_base_v, i_base_g, s, o_k, o_v, HK, HV, K, V)


def default_config(K: int, V: int) -> tuple[int, int]:
    """(BV, num_warps) for a ``[K, V]`` state.

    The fastest of the configurations swept on an H200 (benchmarks/KERNELS_NOTES.md has the
    sweep): one warp keeps the K-reduction of every token inside a warp (shuffles, no
    barrier). The checkpoint stores are streaming (``.cs``, ``store_hint=1`` in the
    launcher), bit-identical to plain stores.
    """
    return min(16, triton.next_power_of_2(V)), 1


def launch_gdn_verify(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    initial_state: torch.Tensor, checkpoints: torch.Tensor | None,
    parents: tuple[int, ...] | None,
    *, scale: float, use_qk_l2norm: bool, final_state_only: bool,
    snapshot: torch.Tensor | None, slot_bank: torch.Tensor | None = None,
    live_slot: torch.Tensor | None = None, out: torch.Tensor | None = None,
    tree_states: torch.Tensor | None = None, tree_table: torch.Tensor | None = None,
    block_v: int | None = None, num_warps: int | None = None, store_hint: int = 1,
) -> torch.Tensor:
    """Launch :func:`gdn_verify_kernel` on validated inputs; returns ``o`` in v's dtype.

    ``out`` (validated: contiguous ``[B, T, HV, V]`` in v's dtype) receives ``o``; ``None``
    allocates it. ``checkpoints=None`` (not ``final_state_only``) stores no state: slot
    step -1, with ``initial_state`` standing in as the (never written) slot pointer — or,
    for a tree, ``tree_states`` as the scratch slots of the nodes a later child reloads.
    """
    B, T, HK, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    g, beta = g.contiguous(), beta.contiguous()
    o = torch.empty_like(v) if out is None else out
    BV, warps = default_config(K, V)
    BV = block_v or BV
    warps = num_warps or warps
    if tree_table is not None:  # filled by its owner (tree_parents_into): graph-safe
        p_parents = tree_table
    elif parents is None:
        p_parents = _constant(_DUMMY_PARENTS, q.device, torch.int32)
    else:  # parents, the flags of the nodes reloaded, the walks (tree_table_values)
        table = torch.frombuffer(tree_table_values(parents), dtype=torch.int32)
        p_parents = table.to(q.device, non_blocking=True)
    slot_step = 0 if final_state_only else 1
    if checkpoints is None:  # no checkpoint: a tree's reloaded nodes go to its scratch
        checkpoints = initial_state.unsqueeze(1) if tree_states is None else tree_states
        slot_step = -1
    snap = initial_state if snapshot is None else snapshot
    bank = checkpoints if slot_bank is None else slot_bank
    live = _constant(_NO_SLOT, q.device, torch.int64) if live_slot is None else live_slot
    # a chain: one launch. A tree: the trunk's launch, then one program per subtree
    # (tree_walks), each starting from its trunk parent's state that the first wrote
    launches = [(1, 0, snapshot is not None)]
    if parents is not None and T > 1:
        launches.append((T - 1, 1, False))
    for walks, walk_base, snapshots in launches:
        gdn_verify_kernel[(triton.cdiv(V, BV), B * HV, walks)](
            q, k, v, g, beta, o,
            initial_state, checkpoints, snap, p_parents, bank, live,
            scale, T, slot_step, 1 if snapshots else 0,
            0 if parents is None else 1, bank.shape[1], walk_base,
            *initial_state.stride(), *bank.stride(), *checkpoints.stride(), *snap.stride(),
            HK=HK, HV=HV, K=K, V=V, BK=triton.next_power_of_2(K), BV=BV,
            USE_QK_L2NORM=use_qk_l2norm, STORE_HINT=store_hint,
            READ_LIVE=0 if live_slot is None else 1, num_warps=warps,
        )
    return o


@triton.jit(do_not_specialize=["commit", "S", "n_max", "has_snapshot"])  # type: ignore[untyped-decorator]  # triton ships no types
def gdn_recompute_kernel(  # type: ignore[no-untyped-def]  # Triton pointers are untyped
    h0, out, snap, x, g, beta,         # [L,B,HV,K,V] x3, x [L,B,S,C] (q|k|v), g/beta [L,B,S,HV]
    rows, cap, commit_ptr, path,       # [L,B,Kc-1,C], [L,B,Kc-1+S,C], int64 [1], int64 [P]
    commit, S, n_max, has_snapshot, B, N_CONV, NC_CHUNKS, n_state_programs,
    s_h0_l, s_h0_b, s_h0_h, s_h0_k, s_h0_v,
    s_out_l, s_out_b, s_out_h, s_out_k, s_out_v,
    s_sn_l, s_sn_b, s_sn_h, s_sn_k, s_sn_v,
    s_x_l, s_x_b, s_x_t, s_g_l, s_g_b, s_g_t, s_be_l, s_be_b, s_be_t,
    s_rw_l, s_rw_b, s_cp_l, s_cp_b, s_cp_t,
    HK: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, USE_QK_L2NORM: tl.constexpr,
    COMMIT_ON_DEVICE: tl.constexpr, BLOCK: tl.constexpr, HAS_PATH: tl.constexpr,
    KC1: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    # n accepted tokens: read on the device and clamped to 1 .. n_max (a compile-time branch)
    if COMMIT_ON_DEVICE:  # noqa: SIM108 - a constexpr if, not an expression, for Triton
        n = tl.minimum(tl.maximum(tl.load(commit_ptr), 1), n_max)
    else:
        n = commit
    # the two branches use distinct names: Triton merges same-named values across an if
    if pid < n_state_programs:
        # a state program: one (layer, batch x value head, value block) tile
        NV = (V + BV - 1) // BV  # value blocks per head (constexpr)
        i_v = pid % NV
        i_lbh = pid // NV
        i_l, i_bh = i_lbh // (B * HV), i_lbh % (B * HV)
        i_b, i_hv = i_bh // HV, i_bh % HV
        i_hk = i_hv // (HV // HK)

        o_k = tl.arange(0, BK)
        o_v = i_v * BV + tl.arange(0, BV)
        m_k = o_k < K
        m_v = o_v < V
        m_h = m_k[:, None] & m_v[None, :]

        p_h0 = (h0 + i_l * s_h0_l + i_b * s_h0_b + i_hv * s_h0_h
                + o_k[:, None] * s_h0_k + o_v[None, :] * s_h0_v)
        # token t's inputs sit in row path[t] (a tree's accepted path; a chain: row t);
        # k and v are columns of the conv output row (q | k | v)
        x_k = x + i_l * s_x_l + i_b * s_x_b + HK * K + i_hk * K + o_k
        x_v = x + i_l * s_x_l + i_b * s_x_b + 2 * HK * K + i_hv * V + o_v
        x_g = g + i_l * s_g_l + i_b * s_g_b + i_hv
        x_beta = beta + i_l * s_be_l + i_b * s_be_b + i_hv
        if HAS_PATH:
            row = tl.minimum(tl.maximum(tl.load(path), 0), S - 1).to(tl.int64)
        else:
            row = (n * 0).to(tl.int64)

        # token t's inputs are loaded during token t-1, as in gdn_verify_kernel
        b_k = tl.load(x_k + row * s_x_t, mask=m_k, other=0).to(tl.float32)
        b_v = tl.load(x_v + row * s_x_t, mask=m_v, other=0).to(tl.float32)
        b_g = tl.load(x_g + row * s_g_t).to(tl.float32)
        b_beta = tl.load(x_beta + row * s_be_t).to(tl.float32)
        b_h = tl.load(p_h0, mask=m_h, other=0).to(tl.float32)
        if has_snapshot != 0:
            p_sn = (snap + i_l * s_sn_l + i_b * s_sn_b + i_hv * s_sn_h
                    + o_k[:, None] * s_sn_k + o_v[None, :] * s_sn_v)
            tl.store(p_sn, b_h, mask=m_h)
        # every read of the state tile happens before its out tile is written (in place)
        tl.debug_barrier()

        t = n * 0  # a scalar of n's type, like the loop bound
        while t < n:  # a while loop: the interpreter cannot range() over a runtime bound
            b_k = _l2norm(b_k, USE_QK_L2NORM)
            b_h = _gated_delta_step(b_h, b_k, b_v, b_g, b_beta)
            more = t + 1 < n
            if HAS_PATH:
                nxt = tl.load(path + t + 1, mask=more, other=0)
                row = tl.minimum(tl.maximum(nxt, 0), S - 1).to(tl.int64)
            else:
                row = (t + 1).to(tl.int64)
            # full-block masks (see gdn_verify_kernel): no lane is read past token n-1
            m_k_next = o_k < tl.where(more, K, 0)
            m_v_next = o_v < tl.where(more, V, 0)
            b_k = tl.load(x_k + row * s_x_t, mask=m_k_next, other=0).to(tl.float32)
            b_v = tl.load(x_v + row * s_x_t, mask=m_v_next, other=0).to(tl.float32)
            b_g = tl.load(x_g + row * s_g_t, mask=more, other=0).to(tl.float32)
            b_beta = tl.load(x_beta + row * s_be_t, mask=more, other=0).to(tl.float32)
            t += 1

        p_out = (out + i_l * s_out_l + i_b * s_out_b + i_hv * s_out_h
                 + o_k[:, None] * s_out_k + o_v[None, :] * s_out_v)
        tl.store(p_out, b_h, mask=m_h)
    else:
        # a conv program: a BLOCK chunk of the Kc-1 window rows of one (layer, batch):
        # entries n .. n+Kc-2 of (the pre-verify window, then the path's rows)
        c_pid = pid - n_state_programs
        c_lb, c_chunk = c_pid // NC_CHUNKS, c_pid % NC_CHUNKS
        c_l, c_b = c_lb // B, c_lb % B
        o_c = c_chunk * BLOCK + tl.arange(0, BLOCK)
        m_c = o_c < N_CONV
        p_cap = cap + c_l * s_cp_l + c_b * s_cp_b
        if HAS_PATH:
            C = N_CONV // KC1
            entry = n + o_c // C  # per element: its window row's entry
            hop = tl.load(path + tl.maximum(entry - KC1, 0), mask=m_c & (entry >= KC1), other=0)
            src = tl.where(entry < KC1, entry, KC1 + tl.minimum(tl.maximum(hop, 0), S - 1))
            b_rows = tl.load(p_cap + src.to(tl.int64) * s_cp_t + o_c % C, mask=m_c)
        else:  # a chain: the captured rows n .. n+Kc-2, contiguous
            b_rows = tl.load(p_cap + n.to(tl.int64) * s_cp_t + o_c, mask=m_c)
        tl.store(rows + c_l * s_rw_l + c_b * s_rw_b + o_c, b_rows, mask=m_c)


def launch_gdn_recompute(
    state: torch.Tensor, inputs: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    conv_rows: torch.Tensor, captured: torch.Tensor, commit_n: int | torch.Tensor, *,
    out: torch.Tensor, snapshot: torch.Tensor | None, head_k: int, use_qk_l2norm: bool,
    path: torch.Tensor | None = None, block: int = 1024,
) -> None:
    """Launch :func:`gdn_recompute_kernel` on validated inputs (``inputs``, ``g``, ``beta``
    with a unit-stride last dimension; ``conv_rows``, ``captured`` dense after ``[L, B]``):
    ``L * B * HV * cdiv(V, BV)`` state programs, then ``L * B * cdiv((Kc-1) * C, block)``
    conv-row programs, in one grid. ``commit_n`` a checked host int or a one-element int64
    device tensor (clamped to ``1 .. min(S, P)`` by the kernel); ``path`` None (a chain) or
    a contiguous int64 ``[P]`` tensor of rows (clamped to ``0 .. S-1``)."""
    L, B, HV, K, V = state.shape
    S = inputs.shape[2]
    BV, warps = default_config(K, V)  # the verify's tile and warps: the same reductions
    n_state_programs = L * B * HV * triton.cdiv(V, BV)
    n_conv = conv_rows[0, 0].numel()
    nc_chunks = triton.cdiv(n_conv, block)
    grid = (n_state_programs + L * B * nc_chunks,)
    on_device = isinstance(commit_n, torch.Tensor)
    snap = state if snapshot is None else snapshot
    gdn_recompute_kernel[grid](
        state, out, snap, inputs, g, beta, conv_rows, captured,
        commit_n if on_device else state, state if path is None else path,
        0 if on_device else commit_n, S, S if path is None else min(S, path.shape[0]),
        0 if snapshot is None else 1, B, n_conv, nc_chunks, n_state_programs,
        *state.stride(), *out.stride(), *snap.stride(),
        *inputs.stride()[:3], *g.stride()[:3], *beta.stride()[:3],
        conv_rows.stride(0), conv_rows.stride(1),
        captured.stride(0), captured.stride(1), captured.stride(2),
        HK=head_k, HV=HV, K=K, V=V, BK=triton.next_power_of_2(K), BV=BV,
        USE_QK_L2NORM=use_qk_l2norm, COMMIT_ON_DEVICE=on_device, BLOCK=block,
        HAS_PATH=path is not None, KC1=conv_rows.shape[2], num_warps=warps,
    )
