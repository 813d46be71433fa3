"""Triton kernels of :func:`~dflash.kernels.sample.gumbel_argmax`: the seeded Gumbel-max
draw over a vocabulary, in two launches.

``gumbel_argmax_chunk_kernel``: a ``[T, chunks]`` grid; each program scales its chunk of
one row's logits, adds the Gumbel noise Philox derives from ``(seed, position, token)``
(``tl.philox``: the bits of the torch reference), drops the tokens under the row's floor
(a floor on the logits: :mod:`dflash.kernels.filter`) and keeps the chunk's maximum and
its first index; a chunk the floor keeps no token of skips the noise (its maximum is
``-inf``). ``gumbel_argmax_reduce_kernel``: one program per row picks the largest
chunk maximum, the lowest index among equals. A maximum is exact whatever the order it is
taken in, so a row's token depends on that row alone — the same in a one-row decode and
in any row of a verify (M-invariance).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

#: vocabulary entries per program of the first launch
CHUNK = 2048


@triton.jit  # type: ignore[untyped-decorator]  # triton ships no types
def gumbel_argmax_chunk_kernel(  # type: ignore[no-untyped-def]  # Triton pointers are untyped
    logits, positions, floor, floor_id,  # [T, V] any float; [T] int64; [T] f32; [T] int64
    best, best_id,                       # [T, chunks] f32 / int64
    seed, inv_t, V, chunks,
    HAS_FLOOR: tl.constexpr, BV: tl.constexpr,
):
    i_t = tl.program_id(0).to(tl.int64)
    i_c = tl.program_id(1)
    o_v = i_c * BV + tl.arange(0, BV)
    m_v = o_v < V
    l = tl.load(logits + i_t * V + o_v, mask=m_v, other=0).to(tl.float32)
    keep = m_v
    if HAS_FLOOR:
        f = tl.load(floor + i_t)
        fid = tl.load(floor_id + i_t)
        keep = m_v & ((l > f) | ((l == f) & (o_v.to(tl.int64) <= fid)))
    # a chunk the floor keeps nothing of (most of them under top-k, or a small nucleus)
    # draws no noise: its maximum is -inf at its first token, as the draw would find it
    top = tl.zeros([], dtype=tl.float32) + float("-inf")
    first = i_c * BV
    if tl.max(keep.to(tl.int32), 0) > 0:
        s = l * inv_t
        p = tl.load(positions + i_t)
        zero = tl.zeros([BV], dtype=tl.uint32)
        bits, _, _, _ = tl.philox(seed, o_v.to(tl.uint32), (zero + p).to(tl.uint32), zero, zero)
        u = ((bits >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)
        x = s + -tl.log(-tl.log(u))
        if HAS_FLOOR:
            x = tl.where(keep, x, float("-inf"))
        x = tl.where(x != x, float("inf"), x)  # NaN ranks as +inf
        x = tl.where(m_v, x, float("-inf"))
        top = tl.max(x, 0)
        first = tl.min(tl.where(x == top, o_v, V), 0)  # an in-row lane always holds the max
    tl.store(best + i_t * chunks + i_c, top)
    tl.store(best_id + i_t * chunks + i_c, first.to(tl.int64))


@triton.jit  # type: ignore[untyped-decorator]  # triton ships no types
def gumbel_argmax_reduce_kernel(  # type: ignore[no-untyped-def]  # Triton pointers are untyped
    best, best_id, out,  # [T, chunks] f32 / int64; [T] int64
    V, chunks, BC: tl.constexpr,
):
    i_t = tl.program_id(0).to(tl.int64)
    o_c = tl.arange(0, BC)
    m_c = o_c < chunks
    x = tl.load(best + i_t * chunks + o_c, mask=m_c, other=float("-inf"))
    ids = tl.load(best_id + i_t * chunks + o_c, mask=m_c, other=V)
    top = tl.max(x, 0)
    tl.store(out + i_t, tl.min(tl.where((x == top) & m_c, ids, V), 0))


def launch_gumbel_argmax(
    logits: torch.Tensor, positions: torch.Tensor, seed: int, inv_temperature: float,
    floor: torch.Tensor | None, floor_id: torch.Tensor | None, out: torch.Tensor,
) -> torch.Tensor:
    """Launch both kernels on validated inputs (``logits`` contiguous ``[T, V]``); the
    tokens land in ``out`` ``[T]`` int64."""
    T, V = logits.shape
    chunks = triton.cdiv(V, CHUNK)
    best = torch.empty(T, chunks, dtype=torch.float32, device=logits.device)
    best_id = torch.empty(T, chunks, dtype=torch.int64, device=logits.device)
    has_floor = floor is not None and floor_id is not None
    gumbel_argmax_chunk_kernel[(T, chunks)](
        logits, positions, floor if has_floor else best, floor_id if has_floor else best_id,
        best, best_id, seed, inv_temperature, V, chunks,
        HAS_FLOOR=has_floor, BV=CHUNK, num_warps=4,
    )
    gumbel_argmax_reduce_kernel[(T,)](
        best, best_id, out, V, chunks, BC=max(triton.next_power_of_2(chunks), 16), num_warps=4
    )
    return out
