"""Triton kernel: restore every recurrent layer of a shard from checkpoint slots, one launch.

Programs ``[0, n_state)`` copy ``BLOCK``-element chunks of the state slot of one
(layer, batch) pair; the remaining programs copy chunks of the ``Kc - 1`` conv rows. Both
sources are contiguous runs (a ``[HV, K, V]`` slot; ``Kc - 1`` consecutive ``[C]`` rows), so
every program issues wide, fully coalesced loads and stores.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit(do_not_specialize=["slot", "S"])  # type: ignore[untyped-decorator]  # triton ships no types
def rollback_restore_kernel(  # type: ignore[no-untyped-def]  # Triton pointers are untyped
    states, ckpt, rows, cap,           # [L,B,HV,K,V], [L,B,S,HV,K,V], [L,B,Kc-1,C], [L,B,Kc-1+S,C]
    slot, commit_ptr, S, B, N_STATE, N_CONV, NS_CHUNKS, NC_CHUNKS, n_state_programs,
    s_st_l, s_st_b, s_ck_l, s_ck_b, s_ck_s, s_rw_l, s_rw_b, s_cp_l, s_cp_b, s_cp_t,
    BLOCK: tl.constexpr, COMMIT_ON_DEVICE: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    # commit_n read on the device, clamped to the slots 0 .. S-1 (a compile-time branch)
    if COMMIT_ON_DEVICE:  # noqa: SIM108 - a constexpr if, not an expression, for Triton
        i_slot = tl.minimum(tl.maximum(tl.load(commit_ptr) - 1, 0), S - 1)
    else:
        i_slot = slot
    o = tl.arange(0, BLOCK)
    # the two branches use distinct names: Triton merges same-named values across an if
    if pid < n_state_programs:
        s_lb, s_chunk = pid // NS_CHUNKS, pid % NS_CHUNKS
        s_l, s_b = s_lb // B, s_lb % B
        o_s = s_chunk * BLOCK + o
        m_s = o_s < N_STATE
        p_src = ckpt + s_l * s_ck_l + s_b * s_ck_b + i_slot * s_ck_s + o_s
        b_state = tl.load(p_src, mask=m_s)
        tl.store(states + s_l * s_st_l + s_b * s_st_b + o_s, b_state, mask=m_s)
    else:
        c_pid = pid - n_state_programs
        c_lb, c_chunk = c_pid // NC_CHUNKS, c_pid % NC_CHUNKS
        c_l, c_b = c_lb // B, c_lb % B
        o_c = c_chunk * BLOCK + o
        m_c = o_c < N_CONV
        # rows commit_n .. commit_n+Kc-2 = slot+1 .. slot+Kc-1
        p_rows = cap + c_l * s_cp_l + c_b * s_cp_b + (i_slot + 1) * s_cp_t + o_c
        b_rows = tl.load(p_rows, mask=m_c)
        tl.store(rows + c_l * s_rw_l + c_b * s_rw_b + o_c, b_rows, mask=m_c)


def launch_rollback_restore(
    states: torch.Tensor, conv_rows: torch.Tensor, checkpoints: torch.Tensor,
    captured: torch.Tensor, commit_n: int | torch.Tensor, *, rows_only: bool = False,
    block: int = 4096, num_warps: int = 8,
) -> None:
    """Launch :func:`rollback_restore_kernel` on validated inputs (inner runs contiguous);
    ``commit_n`` a host int or a one-element int64 device tensor; ``rows_only``: the conv
    rows alone (no state programs)."""
    L, B = states.shape[:2]
    n_state = states[0, 0].numel()
    n_conv = conv_rows[0, 0].numel()
    ns_chunks = triton.cdiv(n_state, block)
    nc_chunks = triton.cdiv(n_conv, block)
    n_state_programs = 0 if rows_only else L * B * ns_chunks
    grid = (n_state_programs + L * B * nc_chunks,)
    on_device = isinstance(commit_n, torch.Tensor)
    if grid[0] == 0:
        return
    rollback_restore_kernel[grid](
        states, checkpoints, conv_rows, captured,
        0 if on_device else commit_n - 1, commit_n if on_device else states,
        checkpoints.shape[2], B, n_state, n_conv, ns_chunks, nc_chunks, n_state_programs,
        states.stride(0), states.stride(1),
        checkpoints.stride(0), checkpoints.stride(1), checkpoints.stride(2),
        conv_rows.stride(0), conv_rows.stride(1),
        captured.stride(0), captured.stride(1), captured.stride(2),
        BLOCK=block, COMMIT_ON_DEVICE=on_device, num_warps=num_warps,
    )
