"""Public entry points: gated delta rule verification with F32 checkpoint capture, and the
recompute of a verify's accepted tokens (the ``recompute`` rollback)."""

from __future__ import annotations

import math

import torch

from dflash.errors import KernelBoundsError
from dflash.geometry import TreeGeometry
from dflash.kernels import checks
from dflash.kernels.gdn_reference import gdn_recompute_reference, gdn_verify_reference
from dflash.kernels.rollback import RollbackBoundsError
from dflash.kernels.rollback import _commit as _commit_count  # the rollback's commit_n rule
from dflash.kernels.tree_paths import tree_table_size

#: Triton holds the whole key dimension of a state tile in registers.
MAX_TRITON_K = 256


def gdn_verify(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor,
    checkpoints: torch.Tensor | None,
    geometry: object,
    *,
    scale: float | None = None,
    use_qk_l2norm: bool = True,
    final_state_only: bool = False,
    snapshot: torch.Tensor | None = None,
    slot_bank: torch.Tensor | None = None,
    live_slot: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    tree_states: torch.Tensor | None = None,
    tree_table: torch.Tensor | None = None,
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
            the state in place). ``None`` (``final_state_only=False``): no state is
            kept, only ``o`` (and ``snapshot``) — a verify whose rollback recomputes the
            state (:func:`gdn_recompute`); a branching tree then needs ``tree_states``.
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
        tree_states: scratch for a branching tree verified with ``checkpoints=None``:
            ``[B, S, HV, K, V]`` float32 with ``S >= T``, sharing no memory with any other
            argument. A node whose state a later child (not the next slot) starts from
            leaves it in its slot there (only those nodes: a depth-first tree writes its
            branch points only); the contents afterwards are unspecified. Given only
            with ``checkpoints=None``; ignored by a chain.
        tree_table: optional int32 one-dimensional tensor of at least ``2*T + T*T``
            entries on the inputs' device, filled from ``geometry`` (a ``TreeGeometry``) by
            :func:`dflash.kernels.tree_parents_into`: the Triton kernel reads the tree's
            parents, the nodes reloaded and its walks (the trunk, then every subtree off
            it, :func:`dflash.kernels.tree_paths.tree_walks`) there instead of from a table
            this call uploads, so a CUDA graph of the call serves every tree of ``T``
            nodes — each replay reads the table as its owner refilled it. The tree is
            then always walked as a tree (a chain-shaped one too). The reference reads
            ``geometry`` and ignores it.
        backend: ``"auto"`` (Triton on CUDA, or on CPU under ``TRITON_INTERPRET=1``;
            the reference otherwise), ``"triton"`` or ``"reference"``.

    Returns:
        o: ``[B, T, HV, V]`` in v's dtype (``out`` when given).

    Raises:
        TypeError: a tensor argument is not a tensor, or ``geometry`` is not a validated
            geometry object (before anything is launched).
        KernelBoundsError: shapes, dtypes or devices disagree, ``T > S``,
            ``n_actual != T``, ``out`` is wrong, ``checkpoints`` is ``None`` with
            ``final_state_only`` or with a branching tree but no ``tree_states``, or
            ``tree_states`` comes with ``checkpoints`` (a ``ValueError``).
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
    if checkpoints is not None:
        checkpoints = checks.tensor("checkpoints", checkpoints, 5)
        S = checkpoints.shape[1]
        checks.shape("checkpoints", checkpoints, (B, S, HV, K, V), "[B, S, HV, K, V]")
        checks.dtype("checkpoints", checkpoints, torch.float32)
        if not final_state_only and S < T:
            raise KernelBoundsError(f"'checkpoints' needs S >= T={T} slots (got S={S})")
        if S < 1:
            raise KernelBoundsError("'checkpoints' needs at least one slot (got S=0)")
    elif final_state_only:
        raise KernelBoundsError(
            "'checkpoints' is None, which stores no state, but final_state_only=True asks "
            "for the final state: pass a slot for it"
        )
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
    if tree_states is not None:
        if checkpoints is not None:
            raise KernelBoundsError(
                "'tree_states' is the scratch of a tree verified without checkpoints; "
                "with 'checkpoints' given the nodes' states go there (pass one of them)"
            )
        tree_states = checks.tensor("tree_states", tree_states, 5)
        checks.shape(
            "tree_states", tree_states, (B, max(T, tree_states.shape[1]), HV, K, V),
            f"[B, S >= T={T}, HV, K, V]",
        )
        checks.dtype("tree_states", tree_states, torch.float32)
    inputs: dict[str, torch.Tensor | None] = {
        "q": q, "k": k, "v": v, "g": g, "beta": beta, "initial_state": initial_state,
        "checkpoints": checkpoints, "snapshot": snapshot, "slot_bank": slot_bank,
        "live_slot": live_slot,
    }
    if out is not None:
        out = checks.output("out", out, (B, T, HV, V), v.dtype, "v.shape [B, T, HV, V]")
        checks.disjoint("out", out, inputs)
    if tree_states is not None:
        checks.disjoint("tree_states", tree_states, {**inputs, "out": out})
    device = checks.same_device({**inputs, "out": out, "tree_states": tree_states})
    parents = checks.geometry_parents(geometry, T, final_state_only)
    if tree_table is not None:
        if not isinstance(geometry, TreeGeometry):
            raise KernelBoundsError(
                f"'tree_table' belongs to a tree verify (got geometry "
                f"{type(geometry).__name__})"
            )
        tree_table = checks.tensor_of("tree_table", tree_table, 1, torch.int32)
        if tree_table.shape[0] < tree_table_size(T) or not tree_table.is_contiguous():
            raise KernelBoundsError(
                f"'tree_table' must be a contiguous int32 tensor of at least 2*T + T*T="
                f"{tree_table_size(T)} entries (got shape {tuple(tree_table.shape)})"
            )
        checks.same_device({"q": q, "tree_table": tree_table})
        parents = tuple(geometry.parents)  # walked as a tree, whatever its shape
    if checkpoints is None and parents is not None and tree_states is None:
        raise KernelBoundsError(
            "'checkpoints' is None but the geometry is a branching tree (parents "
            f"{parents}): its tokens start from their parents' states, so it needs "
            "'tree_states' (scratch for them) or checkpoints"
        )

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
        live_slot=live_slot, out=out, tree_states=tree_states, tree_table=tree_table,
    )


def gdn_recompute(
    state: torch.Tensor,
    inputs: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    conv_rows: torch.Tensor,
    captured: torch.Tensor,
    commit_n: int | torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    snapshot: torch.Tensor | None = None,
    path: torch.Tensor | None = None,
    use_qk_l2norm: bool = True,
    backend: checks.Backend = "auto",
) -> None:
    """Re-run a verify's first ``commit_n`` tokens from the pre-verify state, for all ``L``
    recurrent layers of a shard in one launch (the ``recompute`` rollback) — a chain's
    tokens ``0 .. n-1``, or a tree's accepted root-to-node ``path``.

    For every layer ``l`` and batch row ``b``, with ``n = commit_n`` and ``r_t`` the row of
    token ``t`` (``path[t]``; a chain: ``t``):

    - ``snapshot[l] <- state[l]`` (when given);
    - ``out[l] <-`` the state after the gated delta rule ran from ``state[l]`` over tokens
      ``0 .. n-1``, token ``t`` taking ``k = inputs[l, b, r_t, HK*K : 2*HK*K]`` viewed
      ``[HK, K]``, ``v = inputs[l, b, r_t, 2*HK*K :]`` viewed ``[HV, V]``, ``g`` and
      ``beta`` at ``r_t``; value head ``h`` uses key head ``h // (HV // HK)``. This is
      :func:`gdn_verify`'s per-token update (same L2 norm of k, eps 1e-6, same tile shape
      and reductions), so on the same backend the result equals the verify's checkpoint
      slot ``r_{n-1}``, and ``n`` one-token decodes, bit for bit;
    - ``conv_rows[l] <-`` the conv window after the ``n`` tokens: entries ``n .. n+Kc-2``
      of (``captured[l, :, :Kc-1]``, the pre-verify window, then ``captured[l, :, Kc-1 +
      r_t]`` for ``t = 0, 1, ...``) — a chain's ``captured[l, :, n : n+Kc-1]``.

    Every check runs on the host before anything is launched, so a refused call has changed
    nothing. Triton (on CUDA, or on CPU under ``TRITON_INTERPRET=1``) runs one launch: one
    program per (layer, batch x value head, value block) state tile, plus programs copying
    the conv rows. Each state program reads its whole tile (and writes its snapshot tile)
    before it writes its ``out`` tile, so ``out`` may be ``state`` itself.

    Args:
        state: ``[L, B, HV, K, V]`` float32, the live (pre-verify) states, read; any strides.
        inputs: ``[L, B, S, C]`` the verify's conv outputs per token, ``q | k | v``
            head-major, ``C = 2*HK*K + HV*V`` (``q`` is not read); float16, bfloat16 or
            float32. ``HK = (C - HV*V) / (2*K)`` must be a positive integer dividing ``HV``.
        g: ``[L, B, S, HV]`` float32 log decay per token.
        beta: ``[L, B, S, HV]`` step size, ``inputs``' dtype.
        conv_rows: ``[L, B, Kc-1, C]`` out, ``captured``'s dtype: the conv window.
        captured: ``[L, B, Kc-1+S, C]`` the verify's conv input rows
            (``causal_conv1d_capture``), ``Kc >= 2``.
        commit_n: accepted tokens ``1 <= commit_n <= S``: a host int (checked), or a
            one-element int64 tensor on the tensors' device that the kernel reads, so the
            launch needs no host value and a CUDA graph can hold it. A tensor's value is not
            checked on the host (that would synchronise): it is clamped to ``1 .. S`` (0
            recomputes one token, ``S + 5`` all ``S``); the caller checks the value it reads
            back.
        out: ``None`` (``state`` is updated in place, the normal use) or ``[L, B, HV, K, V]``
            float32, any strides; it must share no memory with any other argument unless it
            is ``state`` itself (or a view of exactly the same elements).
        snapshot: optional ``[L, B, HV, K, V]`` float32, any strides, sharing no memory
            with any other argument: receives a copy of ``state`` as read.
        path: ``None`` (a chain) or a one-dimensional int64 tensor of ``P`` rows
            (``1 <= P <= S``) on the tensors' device: a tree's accepted path of slots, from
            the root (entries past ``commit_n`` are not read). A host ``commit_n`` must be
            ``<= P``; a tensor one is clamped to ``1 .. P``. The rows are checked on the host
            only when ``path`` lives on the CPU (reading a device tensor would synchronise):
            on a device the kernel clamps each to ``0 .. S-1``, so a wrong row cannot read
            out of bounds — the caller passes a validated path (``VerifyRecord``).
        use_qk_l2norm: L2-normalise k per head, as the verify did.
        backend: ``"auto"``, ``"triton"`` or ``"reference"`` (see :func:`gdn_verify`); use
            the verify's backend, since the bits are each backend's own. Triton needs the
            last dimension of ``inputs``, ``g`` and ``beta`` unit-stride, ``conv_rows`` and
            ``captured`` dense after their ``[L, B]`` dims, and ``K <= 256``; the leading
            dims may be strided views of larger buffers.

    Raises:
        TypeError: a tensor argument is not a tensor.
        KernelBoundsError: shapes, dtypes, devices or layouts disagree, ``C`` does not
            give a valid ``HK``, or ``out`` / ``snapshot`` overlap another argument (a
            ``ValueError``).
        RollbackBoundsError: ``commit_n`` is not an int in ``1 .. S`` nor a one-element
            int64 tensor (a ``KernelBoundsError``).
    """
    state = checks.tensor("state", state, 5)
    L, B, HV, K, V = state.shape
    checks.dtype("state", state, torch.float32)
    if min(L, B, HV, K, V) < 1:
        raise KernelBoundsError(
            f"'state' [L, B, HV, K, V] must have no empty dimension (got {tuple(state.shape)})"
        )
    inputs = checks.tensor("inputs", inputs, 4)
    S, C = inputs.shape[2], inputs.shape[3]
    checks.shape("inputs", inputs, (L, B, S, C), "[L, B, S, C] with L, B from 'state'")
    if S < 1:
        raise KernelBoundsError("'inputs' must hold at least one token (got S=0)")
    if inputs.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise KernelBoundsError(
            f"'inputs' must be float16, bfloat16 or float32 (got {inputs.dtype})"
        )
    HK, rest = divmod(C - HV * V, 2 * K)
    if rest != 0 or HK < 1 or HV % HK != 0:
        raise KernelBoundsError(
            f"'inputs' channels C={C} must be 2*HK*K + HV*V with HK a positive divisor of "
            f"HV={HV}, for V={V}, K={K} from 'state' (got HK = (C - HV*V) / (2*K) = "
            f"{(C - HV * V) / (2 * K):g})"
        )
    g = checks.tensor("g", g, 4)
    checks.shape("g", g, (L, B, S, HV), "[L, B, S, HV]")
    checks.dtype("g", g, torch.float32)
    beta = checks.tensor("beta", beta, 4)
    checks.shape("beta", beta, (L, B, S, HV), "[L, B, S, HV]")
    checks.dtype("beta", beta, inputs.dtype)
    captured = checks.tensor("captured", captured, 4)
    Kc1 = captured.shape[2] - S
    checks.shape("captured", captured, (L, B, captured.shape[2], C), "[L, B, Kc-1+S, C]")
    if Kc1 < 1:
        raise KernelBoundsError(
            f"'captured' must have Kc-1+S rows with Kc >= 2 and S={S} from 'inputs' "
            f"(got {captured.shape[2]})"
        )
    conv_rows = checks.tensor("conv_rows", conv_rows, 4)
    checks.shape("conv_rows", conv_rows, (L, B, Kc1, C), "[L, B, Kc-1, C] from 'captured'")
    checks.dtype("conv_rows", conv_rows, captured.dtype)
    n = _commit_count(commit_n, S)
    if path is not None:
        path = checks.index_vector("path", path)
        P = path.shape[0]
        if not 1 <= P <= S:
            raise KernelBoundsError(f"'path' must hold 1 .. S={S} rows (got {P})")
        if isinstance(n, int) and n > P:
            raise RollbackBoundsError(f"'commit_n'={n} exceeds the path's {P} rows")
        if path.device.type == "cpu":
            bad = [r for r in path.tolist() if not 0 <= r < S]
            if bad:
                raise KernelBoundsError(f"'path' rows must be in [0, S={S}) (got {bad})")
    if snapshot is not None:
        snapshot = checks.tensor("snapshot", snapshot, 5)
        checks.shape("snapshot", snapshot, (L, B, HV, K, V), "'state'.shape [L, B, HV, K, V]")
        checks.dtype("snapshot", snapshot, torch.float32)
    if out is not None:
        out = checks.tensor("out", out, 5)
        checks.shape("out", out, (L, B, HV, K, V), "'state'.shape [L, B, HV, K, V]")
        checks.dtype("out", out, torch.float32)
        if out.data_ptr() == state.data_ptr() and out.stride() == state.stride():
            out = None  # the same elements as ``state``: in place
    named: dict[str, torch.Tensor | None] = {
        "state": state, "inputs": inputs, "g": g, "beta": beta, "conv_rows": conv_rows,
        "captured": captured, "commit_n": n if isinstance(n, torch.Tensor) else None,
        "out": out, "snapshot": snapshot, "path": path,
    }
    device = checks.same_device(named)
    for name in ("out", "snapshot", "conv_rows"):  # the outputs, each apart from the rest
        written = named[name]
        if written is not None:
            checks.disjoint(name, written, {o: t for o, t in named.items() if o != name})

    if not checks.use_triton(backend, device):
        gdn_recompute_reference(
            state, inputs, g, beta, conv_rows, captured, n, out=out, snapshot=snapshot,
            path=path, use_qk_l2norm=use_qk_l2norm,
        )
        return
    if K > MAX_TRITON_K:
        raise KernelBoundsError(
            f"'state' head dim K must be <= {MAX_TRITON_K} for Triton (got {K})"
        )
    for name, t in (("inputs", inputs), ("g", g), ("beta", beta)):
        if t.stride(3) != 1 and t.shape[3] > 1:
            raise KernelBoundsError(
                f"'{name}' must have a unit-stride last dimension for Triton "
                f"(got strides {t.stride()})"
            )
    for name, t in (("conv_rows", conv_rows), ("captured", captured)):
        if t.stride()[2:] != (C, 1) and t[0, 0].numel() > 1:
            raise KernelBoundsError(
                f"'{name}' must be contiguous after its [L, B] dims for Triton "
                f"(strides {t.stride()})"
            )
    from dflash.kernels.gdn_triton import launch_gdn_recompute

    launch_gdn_recompute(
        state, inputs, g, beta, conv_rows, captured, n,
        out=state if out is None else out, snapshot=snapshot, head_k=HK,
        use_qk_l2norm=use_qk_l2norm, path=None if path is None else path.contiguous(),
    )
