"""Public entry point: the gated delta rule over a long prompt (prefill) in chunk-parallel
form, updating the recurrent state in place.

It computes what a token-by-token prefill computes — ``gdn_verify(q, k, v, g, beta, state,
state.unsqueeze(1), None, final_state_only=True)`` — within floating-point tolerance, but
``chunk`` tokens at a time with matrix products (the WY form; the recurrences are in
:mod:`dflash.kernels.gdn_chunk_reference`). The result is not bit-identical to the token
kernel, so a state reached by this prefill matches a decoded one only within tolerance.
"""

from __future__ import annotations

import math

import torch

from dflash.errors import KernelBoundsError
from dflash.kernels import checks
from dflash.kernels.gdn import MAX_TRITON_K
from dflash.kernels.gdn_chunk_reference import gdn_chunk_prefill_reference

#: the Triton kernels hold a ``[chunk, chunk]`` matrix per program in registers
MAX_TRITON_CHUNK = 128
#: the Triton products' input precisions (``tl.dot``'s ``input_precision``)
PRECISIONS = ("ieee", "tf32")


def gdn_chunk_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    *,
    scale: float | None = None,
    use_qk_l2norm: bool = True,
    chunk: int = 64,
    out: torch.Tensor | None = None,
    backend: checks.Backend = "auto",
    precision: str = "ieee",
) -> torch.Tensor:
    """Run the gated delta rule over ``T`` prompt tokens, ``chunk`` tokens at a time.

    Per value head ``h`` (key head ``h // (HV // HK)``) and token ``t``, with q and k
    L2-normalised (when ``use_qk_l2norm``) and q scaled by ``scale``::

        S <- S * exp(g_t);   S <- S + k_t (beta_t (v_t - S^T k_t))^T;   o_t = S^T q_t

    Every check runs on the host before anything is launched, so a refused call has
    changed nothing. Triton (on CUDA, or on CPU under ``TRITON_INTERPRET=1``) runs two
    launches: the chunks' WY factors in parallel, then one pass over the chunks per
    (batch x value head, value block) state tile (:mod:`dflash.kernels.gdn_chunk_triton`).
    Deterministic, but not bit-identical to :func:`dflash.kernels.gdn_verify`.

    Args:
        q, k: ``[B, T, HK, K]`` queries and keys (float16/bfloat16/float32; the reference
            also float64), ``T >= 1``.
        v: ``[B, T, HV, V]`` values in q's dtype, ``HV`` a multiple of ``HK``.
        g: ``[B, T, HV]`` log decay (float32 usually). beta: ``[B, T, HV]`` step size.
        state: ``[B, HV, K, V]`` float32: read as the initial state and overwritten in
            place with the state after the last token. Any strides (a slot of a pool);
            it shares no memory with the inputs or ``out``.
        scale: query scale, default ``K ** -0.5``.
        use_qk_l2norm: L2-normalise q and k per head (eps 1e-6) inside the kernel.
        chunk: tokens per chunk, a power of two ``>= 16`` (Triton: ``<= 128``). ``T``
            need not be a multiple: the last chunk is partial.
        out: ``None`` (allocated) or a contiguous ``[B, T, HV, V]`` tensor in v's dtype on
            the inputs' device, sharing no memory with any other argument; receives ``o``.
        backend: ``"auto"`` (Triton on CUDA, or on CPU under ``TRITON_INTERPRET=1``; the
            reference otherwise), ``"triton"`` or ``"reference"``.
        precision: the Triton products' inputs: ``"ieee"`` (float32 throughout, the
            default) or ``"tf32"`` (tensor-core products on 10-bit mantissas, float32
            sums); the reference computes in float32 (float64 inputs: float64) either way.

    Returns:
        o: ``[B, T, HV, V]`` in v's dtype (``out`` when given).

    Raises:
        TypeError: a tensor argument is not a tensor, ``use_qk_l2norm`` is not a bool or
            ``chunk`` not an int.
        KernelBoundsError: shapes, dtypes or devices disagree, ``T = 0``, ``state`` is not
            float32, ``chunk`` is not a power of two ``>= 16``, ``precision`` is not one
            of :data:`PRECISIONS`, ``scale`` is not finite,
            ``out`` is wrong, ``state`` or ``out`` overlaps another argument, or the Triton
            limits (``K <= 256``, ``chunk <= 128``) are exceeded (a ``ValueError``).
    """
    q = checks.tensor("q", q, 4)
    B, T, HK, K = q.shape
    k = checks.tensor("k", k, 4)
    checks.shape("k", k, (B, T, HK, K), "q.shape [B, T, HK, K]")
    v = checks.tensor("v", v, 4)
    HV, V = v.shape[2], v.shape[3]
    checks.shape("v", v, (B, T, HV, V), "[B, T, HV, V] with B, T from q")
    if T < 1:
        raise KernelBoundsError(f"'q' must hold at least one token (got T={T})")
    if HK < 1 or HV % HK != 0:
        raise KernelBoundsError(f"'v' heads HV={HV} must be a positive multiple of q's HK={HK}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise KernelBoundsError(
            f"'q', 'k', 'v' must share a dtype (got {q.dtype}, {k.dtype}, {v.dtype})"
        )
    g = checks.tensor("g", g, 3)
    checks.shape("g", g, (B, T, HV), "[B, T, HV]")
    beta = checks.tensor("beta", beta, 3)
    checks.shape("beta", beta, (B, T, HV), "[B, T, HV]")
    state = checks.tensor("state", state, 4)
    checks.shape("state", state, (B, HV, K, V), "[B, HV, K, V]")
    checks.dtype("state", state, torch.float32)
    if scale is not None and not (isinstance(scale, (int, float)) and math.isfinite(scale)):
        raise KernelBoundsError(f"'scale' must be a finite number or None (got {scale!r})")
    if not isinstance(use_qk_l2norm, bool):
        raise TypeError(f"'use_qk_l2norm' must be a bool (got {type(use_qk_l2norm).__name__})")
    if not isinstance(chunk, int) or isinstance(chunk, bool):
        raise TypeError(f"'chunk' must be an int (got {type(chunk).__name__})")
    if chunk < 16 or chunk & (chunk - 1):
        raise KernelBoundsError(f"'chunk' must be a power of two >= 16 (got {chunk})")
    if precision not in PRECISIONS:
        raise KernelBoundsError(
            f"'precision' must be one of {', '.join(PRECISIONS)} (got {precision!r})"
        )
    inputs: dict[str, torch.Tensor | None] = {"q": q, "k": k, "v": v, "g": g, "beta": beta}
    checks.disjoint("state", state, inputs)
    if out is not None:
        out = checks.output("out", out, (B, T, HV, V), v.dtype, "v.shape [B, T, HV, V]")
        checks.disjoint("out", out, {**inputs, "state": state})
    device = checks.same_device({**inputs, "state": state, "out": out})

    if not checks.use_triton(backend, device):
        return gdn_chunk_prefill_reference(
            q, k, v, g, beta, state, scale=scale, use_qk_l2norm=use_qk_l2norm, chunk=chunk,
            out=out,
        )
    if K > MAX_TRITON_K:
        raise KernelBoundsError(f"'q' head dim K must be <= {MAX_TRITON_K} for Triton (got {K})")
    if chunk > MAX_TRITON_CHUNK:
        raise KernelBoundsError(
            f"'chunk' must be <= {MAX_TRITON_CHUNK} for Triton (got {chunk})"
        )
    from dflash.kernels.gdn_chunk_triton import launch_gdn_chunk_prefill

    return launch_gdn_chunk_prefill(
        q, k, v, g, beta, state, scale=K**-0.5 if scale is None else float(scale),
        use_qk_l2norm=use_qk_l2norm, chunk=chunk, out=out, dot_precision=precision,
    )
