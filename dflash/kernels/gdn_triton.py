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
a barrier, so it is race-free.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_DUMMY_PARENTS: dict[torch.device, torch.Tensor] = {}
_NO_SLOT: dict[torch.device, torch.Tensor] = {}  # int64 [1] = -1: the initial state is h0


def _constant(cache: dict[torch.device, torch.Tensor], device: torch.device,
              dtype: torch.dtype) -> torch.Tensor:
    """A one-element tensor holding -1 on ``device`` (made once per device)."""
    got = cache.get(device)
    if got is None:
        got = cache.setdefault(device, torch.full((1,), -1, dtype=dtype, device=device))
    return got


@triton.jit(do_not_specialize=["T", "slot_step", "has_snapshot", "is_tree", "bank_slots"])  # type: ignore[untyped-decorator]  # triton ships no types
def gdn_verify_kernel(  # type: ignore[no-untyped-def]  # Triton pointers are untyped
    q, k, v, g, beta, o,               # inputs [B,T,HK,K] x2, [B,T,HV,V], [B,T,HV] x2; o like v
    h0, ckpt, snap, parents,           # state [B,HV,K,V], slots [B,S,HV,K,V], snapshot, int32 [T]
    bank, live,                        # slots [B,S',HV,K,V] read when *live >= 0; int64 [1]
    scale, T, slot_step, has_snapshot, is_tree, bank_slots,
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

    p_q = q + (i_b * T * HK + i_hk) * K + o_k
    p_k = k + (i_b * T * HK + i_hk) * K + o_k
    p_v = v + (i_b * T * HV + i_hv) * V + o_v
    p_o = o + (i_b * T * HV + i_hv) * V + o_v
    p_g = g + i_b * T * HV + i_hv
    p_beta = beta + i_b * T * HV + i_hv

    # the live slot (slot remap) is issued first: its latency overlaps the first token's
    # loads below instead of delaying the state tile
    if READ_LIVE:
        live_slot = tl.load(live)
    # token t's inputs are loaded during token t-1 (a hand-written one-deep pipeline)
    b_q = tl.load(p_q, mask=m_k, other=0).to(tl.float32)
    b_k = tl.load(p_k, mask=m_k, other=0).to(tl.float32)
    b_v = tl.load(p_v, mask=m_v, other=0).to(tl.float32)
    b_g = tl.load(p_g).to(tl.float32)
    b_beta = tl.load(p_beta).to(tl.float32)
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

    t = T * 0  # an int32 scalar, like the loop bound
    while t < T:  # a while loop: the interpreter cannot range() over a runtime bound
        if is_tree != 0:
            parent = tl.load(parents + t)
            if parent != t - 1:
                # the parent's slot was written by this program earlier in this loop
                tl.debug_barrier()
                b_h = tl.load(ckpt + parent.to(tl.int64) * s_ck_s + o_ck, mask=m_h, other=0)
        if USE_QK_L2NORM:
            b_q = b_q / tl.sqrt(tl.sum(b_q * b_q) + 1e-6)
            b_k = b_k / tl.sqrt(tl.sum(b_k * b_k) + 1e-6)
        b_q = b_q * scale

        b_h *= tl.exp(b_g)
        b_u = b_beta * (b_v - tl.sum(b_h * b_k[:, None], 0))   # beta (v - S^T k): [BV]
        b_h += b_k[:, None] * b_u[None, :]
        b_o = tl.sum(b_h * b_q[:, None], 0)                    # S^T q: [BV]
        tl.store(p_o, b_o.to(p_o.dtype.element_ty), mask=m_v)

        # slot_step 1: slot t after every token; slot_step 0: slot 0 after the last token
        if (slot_step != 0) | (t == T - 1):
            p_slot = ckpt + (t * slot_step).to(tl.int64) * s_ck_s + o_ck
            if STORE_HINT == 1:
                tl.store(p_slot, b_h, mask=m_h, cache_modifier=".cs")
            elif STORE_HINT == 2:
                tl.store(p_slot, b_h, mask=m_h, eviction_policy="evict_first")
            else:
                tl.store(p_slot, b_h, mask=m_h)

        p_q += HK * K
        p_k += HK * K
        p_v += HV * V
        p_o += HV * V
        p_g += HV
        p_beta += HV
        more = t + 1 < T
        # the next token's block masks compare full blocks (a block ``&`` a scalar is not
        # a boolean mask for every triton interpreter): no key/value lane past the last token
        m_k_next = o_k < tl.where(more, K, 0)
        m_v_next = o_v < tl.where(more, V, 0)
        b_q = tl.load(p_q, mask=m_k_next, other=0).to(tl.float32)
        b_k = tl.load(p_k, mask=m_k_next, other=0).to(tl.float32)
        b_v = tl.load(p_v, mask=m_v_next, other=0).to(tl.float32)
        b_g = tl.load(p_g, mask=more, other=0).to(tl.float32)
        b_beta = tl.load(p_beta, mask=more, other=0).to(tl.float32)
        t += 1


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
    initial_state: torch.Tensor, checkpoints: torch.Tensor, parents: tuple[int, ...] | None,
    *, scale: float, use_qk_l2norm: bool, final_state_only: bool,
    snapshot: torch.Tensor | None, slot_bank: torch.Tensor | None = None,
    live_slot: torch.Tensor | None = None, out: torch.Tensor | None = None,
    block_v: int | None = None, num_warps: int | None = None, store_hint: int = 1,
) -> torch.Tensor:
    """Launch :func:`gdn_verify_kernel` on validated inputs; returns ``o`` in v's dtype.

    ``out`` (validated: contiguous ``[B, T, HV, V]`` in v's dtype) receives ``o``; ``None``
    allocates it.
    """
    B, T, HK, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    g, beta = g.contiguous(), beta.contiguous()
    o = torch.empty_like(v) if out is None else out
    BV, warps = default_config(K, V)
    BV = block_v or BV
    warps = num_warps or warps
    if parents is None:
        p_parents = _constant(_DUMMY_PARENTS, q.device, torch.int32)
    else:
        p_parents = torch.tensor(parents, dtype=torch.int32).to(q.device, non_blocking=True)
    snap = initial_state if snapshot is None else snapshot
    bank = checkpoints if slot_bank is None else slot_bank
    live = _constant(_NO_SLOT, q.device, torch.int64) if live_slot is None else live_slot
    grid = (triton.cdiv(V, BV), B * HV)
    gdn_verify_kernel[grid](
        q, k, v, g, beta, o,
        initial_state, checkpoints, snap, p_parents, bank, live,
        scale, T, 0 if final_state_only else 1, 0 if snapshot is None else 1,
        0 if parents is None else 1, bank.shape[1],
        *initial_state.stride(), *bank.stride(), *checkpoints.stride(), *snap.stride(),
        HK=HK, HV=HV, K=K, V=V, BK=triton.next_power_of_2(K), BV=BV,
        USE_QK_L2NORM=use_qk_l2norm, STORE_HINT=store_hint,
        READ_LIVE=0 if live_slot is None else 1, num_warps=warps,
    )
    return o
