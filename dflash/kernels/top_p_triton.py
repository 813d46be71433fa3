"""Triton kernel: the top-p (nucleus) cut of sorted rows, one program per row.

For a row ``s`` sorted in descending order, ``p_j = exp(s_j - s_0) / Z`` with
``Z = sum_j exp(s_j - s_0)`` and ``before_j = p_0 + ... + p_{j-1}``; the kernel writes the
number of leading entries with ``before_j < top_p`` (at least 1), all in float32.

Pass 1 sums ``exp(s_j - s_0)`` over the row in chunks of ``BV`` visited in order (one
``BV``-wide accumulator, reduced once at the end). Pass 2 walks the chunks in order
carrying the mass of the previous chunks, forms each chunk's exclusive prefix with
``tl.cumsum`` over the chunk's entries shifted by one (entry ``j`` sees ``p_{j-1}``) and
stops at the first chunk that holds an entry whose prefix reached ``top_p``: the rows are
sorted, so the cut usually lies in the first chunk. The summation order depends on ``V``
and ``BV`` alone, never on the number of rows, so a row's count is the same whatever the
call holds (M-invariance, which bitwise parity of sampled decoding relies on).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

#: Chunk width for long rows: a 262,144-entry vocabulary is 64 chunks in pass 1, 16 float32
#: per thread at 8 warps; rows shorter than this use the next power of two of their length.
BLOCK = 4096


@triton.jit  # type: ignore[untyped-decorator]  # triton ships no types
def top_p_count_kernel(  # type: ignore[no-untyped-def]  # Triton pointers are untyped
    s, n_keep,                 # s: [T, V] row-major float32, sorted descending; n_keep: [T] int64
    top_p, V,
    BV: tl.constexpr,
):
    i_t = tl.program_id(0).to(tl.int64)
    p_s = s + i_t * V
    b_s0 = tl.load(p_s)                      # the row's largest score (finite)
    o_v = tl.arange(0, BV)
    # pass 1: Z = sum_j exp(s_j - s_0), chunks in order, one reduction at the end
    b_acc = tl.zeros([BV], dtype=tl.float32)
    v0 = 0
    while v0 < V:  # a while loop: the interpreter cannot range() over a runtime bound
        o_j = v0 + o_v
        b_x = tl.load(p_s + o_j, mask=o_j < V, other=float("-inf"))
        b_acc += tl.exp(b_x - b_s0)          # -inf (tail or padding) gives 0
        v0 += BV
    b_z = tl.sum(b_acc, axis=0)
    # pass 2: the first j >= 1 with before_j >= top_p; before_0 = 0 is always kept
    b_run = tl.zeros([], dtype=tl.float32)   # sum of p_k over k < v0 - 1
    b_n = tl.zeros([], dtype=tl.int32) + V   # V until a cut is found
    v0 = 0
    while v0 < V:
        o_j = v0 + o_v
        m_prev = (o_j >= 1) & (o_j <= V)      # p_{j-1} exists
        b_x = tl.load(p_s + o_j - 1, mask=m_prev, other=float("-inf"))
        b_q = tl.exp(b_x - b_s0) / b_z        # p_{j-1} (0 for j = 0 and padding)
        b_before = b_run + tl.cumsum(b_q, axis=0)
        m_cut = (o_j >= 1) & (o_j < V) & (b_before >= top_p)
        b_first = tl.min(tl.where(m_cut, o_j, V), axis=0)
        b_n = tl.minimum(b_n, b_first)
        b_run += tl.sum(b_q, axis=0)
        v0 = tl.where(b_first < V, V, v0 + BV)  # found: leave the loop
    tl.store(n_keep + i_t, b_n.to(tl.int64))


def launch_top_p_count(
    sorted_scores: torch.Tensor, top_p: float, *, out: torch.Tensor | None = None,
    block: int = BLOCK,
) -> torch.Tensor:
    """Launch :func:`top_p_count_kernel` on validated inputs; returns ``n_keep: [T]`` int64.

    ``sorted_scores`` is a contiguous ``[T, V]`` float32 tensor, ``top_p`` a float32 value
    in ``[0, 1]`` (as a Python float), ``out`` (validated: contiguous ``[T]`` int64)
    receives the counts; ``None`` allocates them. ``block`` (a power of two) caps the chunk
    width; smaller values exist to test chunk boundaries on short rows.
    """
    T, V = sorted_scores.shape
    n_keep = (
        torch.empty(T, dtype=torch.int64, device=sorted_scores.device) if out is None else out
    )
    BV = min(block, max(16, triton.next_power_of_2(V)))
    top_p_count_kernel[(T,)](
        sorted_scores, n_keep, top_p, V, BV=BV, num_warps=8 if BV >= 2048 else 4,
    )
    return n_keep
