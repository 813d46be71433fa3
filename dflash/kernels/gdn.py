"""Public entry point: gated delta rule verification with F32 checkpoint capture."""

from __future__ import annotations

import math

import torch

from dflash.errors import KernelBoundsError
from dflash.kernels import checks
from dflash.kernels.gdn_reference import gdn_verify_reference

#: Triton holds the whole key dimension of a state tile in registers.
MAX_TRITON_K = 256


def gdn_verify(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor,
    checkpoints: torch.Tensor,
    geometry: object,
    *,
    scale: float | None = None,
    use_qk_l2norm: bool = True,
    final_state_only: bool = False,
    snapshot: torch.Tensor | None = None,
    slot_bank: torch.Tensor | None = None,
    live_slot: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    backend: checks.Backend = "auto",
) -> torch.Tensor:
    """Run the gated delta rule over ``T`` tokens, capturing the state after each token.

    Args:
        q, k: ``[B, T, HK, K]`` queries and keys (float16/bfloat16/float32).
        v: ``[B, T, HV, V]`` values, ``HV`` a multiple of ``HK``; value head ``h`` uses
            key head ``h // (HV // HK)``.
        g: ``[B, T, HV]`` log decay. beta: ``[B, T, HV]`` step size.
        initial_state: ``[B, HV, K, V]`` float32, read only; may be any strided view,
            including a slot of ``checkpoints`` (slot remap).
        checkpoints: ``[B, S, HV, K, V]`` float32 with ``S >= T``; slot ``t`` receives the
            state after token ``t``. With ``final_state_only`` only slot 0 is written, with
            the state after the last token (pass ``initial_state.unsqueeze(1)`` to update
            the state in place).
        geometry: a validated ``ChainGeometry`` or ``TreeGeometry`` with ``n_actual == T``
            (tree: token ``t`` starts from its parent's slot, the root from
            ``initial_state``). ``None`` only with ``final_state_only=True``.
        scale: query scale, default ``K ** -0.5``.
        use_qk_l2norm: L2-normalise q and k per head (eps 1e-6) inside the kernel.
        snapshot: optional ``[B, HV, K, V]`` float32, receives a copy of the initial state.
        slot_bank, live_slot: given together or not at all. ``slot_bank``
            ``[B, S', HV, K, V]`` float32 and ``live_slot`` a one-element int64 tensor read
            *on the device*: when it holds ``s >= 0`` the initial state is
            ``slot_bank[:, s]`` instead of ``initial_state`` (slot remap without a host
            value, so one CUDA graph serves every slot; ``slot_bank`` may be
            ``checkpoints``). Its value is not checked on the host (that would synchronise);
            the kernel clamps it to ``S' - 1`` so a wrong value cannot read out of bounds.
        out: ``None`` (allocated) or a contiguous ``[B, T, HV, V]`` tensor in v's dtype on
            the inputs' device, sharing no memory with any other argument; receives ``o``.
        backend: ``"auto"`` (Triton on CUDA, or on CPU under ``TRITON_INTERPRET=1``;
            the reference otherwise), ``"triton"`` or ``"reference"``.

    Returns:
        o: ``[B, T, HV, V]`` in v's dtype (``out`` when given).

    Raises:
        TypeError: a tensor argument is not a tensor, or ``geometry`` is not a validated
            geometry object (before anything is launched).
        KernelBoundsError: shapes, dtypes or devices disagree, ``T > S``,
            ``n_actual != T``, or ``out`` is wrong (a ``ValueError``).
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
    initial_state = checks.tensor("initial_state", initial_state, 4)
    checks.shape("initial_state", initial_state, (B, HV, K, V), "[B, HV, K, V]")
    checks.dtype("initial_state", initial_state, torch.float32)
    checkpoints = checks.tensor("checkpoints", checkpoints, 5)
    S = checkpoints.shape[1]
    checks.shape("checkpoints", checkpoints, (B, S, HV, K, V), "[B, S, HV, K, V]")
    checks.dtype("checkpoints", checkpoints, torch.float32)
    if not final_state_only and S < T:
        raise KernelBoundsError(f"'checkpoints' needs S >= T={T} slots (got S={S})")
    if S < 1:
        raise KernelBoundsError("'checkpoints' needs at least one slot (got S=0)")
    if snapshot is not None:
        snapshot = checks.tensor("snapshot", snapshot, 4)
        checks.shape("snapshot", snapshot, (B, HV, K, V), "[B, HV, K, V]")
        checks.dtype("snapshot", snapshot, torch.float32)
    if (slot_bank is None) != (live_slot is None):
        raise KernelBoundsError(
            "'slot_bank' and 'live_slot' are given together or not at all "
            f"(got slot_bank={'a tensor' if slot_bank is not None else None}, "
            f"live_slot={'a tensor' if live_slot is not None else None})"
        )
    if slot_bank is not None:
        slot_bank = checks.tensor("slot_bank", slot_bank, 5)
        if slot_bank.shape[1] < 1:
            raise KernelBoundsError("'slot_bank' needs at least one slot (got S'=0)")
        checks.shape(
            "slot_bank", slot_bank, (B, slot_bank.shape[1], HV, K, V), "[B, S', HV, K, V]"
        )
        checks.dtype("slot_bank", slot_bank, torch.float32)
        live_slot = checks.device_index("live_slot", live_slot)
    if scale is not None and not (isinstance(scale, (int, float)) and math.isfinite(scale)):
        raise KernelBoundsError(f"'scale' must be a finite number or None (got {scale!r})")
    inputs: dict[str, torch.Tensor | None] = {
        "q": q, "k": k, "v": v, "g": g, "beta": beta, "initial_state": initial_state,
        "checkpoints": checkpoints, "snapshot": snapshot, "slot_bank": slot_bank,
        "live_slot": live_slot,
    }
    if out is not None:
        out = checks.output("out", out, (B, T, HV, V), v.dtype, "v.shape [B, T, HV, V]")
        checks.disjoint("out", out, inputs)
    device = checks.same_device({**inputs, "out": out})
    parents = checks.geometry_parents(geometry, T, final_state_only)

    if not checks.use_triton(backend, device):
        if slot_bank is not None and live_slot is not None:  # the reference reads it here
            s = min(int(live_slot.reshape(())), slot_bank.shape[1] - 1)
            initial_state = initial_state if s < 0 else slot_bank[:, s]
        return gdn_verify_reference(
            q, k, v, g, beta, initial_state, checkpoints, geometry, scale=scale,
            use_qk_l2norm=use_qk_l2norm, final_state_only=final_state_only, snapshot=snapshot,
            out=out,
        )
    if K > MAX_TRITON_K:
        raise KernelBoundsError(f"'q' head dim K must be <= {MAX_TRITON_K} for Triton (got {K})")
    from dflash.kernels.gdn_triton import launch_gdn_verify

    return launch_gdn_verify(
        q, k, v, g, beta, initial_state, checkpoints, parents,
        scale=K**-0.5 if scale is None else float(scale), use_qk_l2norm=use_qk_l2norm,
        final_state_only=final_state_only, snapshot=snapshot, slot_bank=slot_bank,
        live_slot=live_slot, out=out,
    )
