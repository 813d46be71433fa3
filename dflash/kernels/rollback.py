"""Public entry points: one-launch rollback restore, and the zero-copy slot-remap views."""

from __future__ import annotations

import torch

from dflash.errors import KernelBoundsError
from dflash.kernels import checks
from dflash.kernels.rollback_reference import rollback_restore_reference


class RollbackBoundsError(KernelBoundsError):
    """A rollback was refused on the host, before any launch; the message names the value.

    A :class:`~dflash.errors.KernelBoundsError`, hence also a ``ValueError``.
    """


def _present(name: str, value: object, ndim: int) -> torch.Tensor:
    if value is None:
        raise RollbackBoundsError(f"'{name}' storage is missing (got None)")
    if not isinstance(value, torch.Tensor):
        raise RollbackBoundsError(f"'{name}' must be a torch.Tensor (got {type(value).__name__})")
    if value.ndim != ndim:
        raise RollbackBoundsError(
            f"'{name}' must have {ndim} dimensions (got shape {tuple(value.shape)})"
        )
    return value


def _commit(commit_n: object, S: int) -> int | torch.Tensor:
    if isinstance(commit_n, torch.Tensor):  # read on the device: its range is not checked here
        if commit_n.dtype != torch.int64 or commit_n.numel() != 1:
            raise RollbackBoundsError(
                f"a tensor 'commit_n' must be one int64 element (got dtype {commit_n.dtype}, "
                f"shape {tuple(commit_n.shape)})"
            )
        return commit_n
    if isinstance(commit_n, bool) or not isinstance(commit_n, int):
        raise RollbackBoundsError(
            f"'commit_n' must be an int or a one-element int64 tensor (got {commit_n!r})"
        )
    if not 1 <= commit_n <= S:
        raise RollbackBoundsError(
            f"'commit_n' must satisfy 1 <= commit_n <= S={S} (got {commit_n})"
        )
    return commit_n


def _check_storage(
    checkpoints: object, captured: object, commit_n: object
) -> tuple[torch.Tensor, torch.Tensor, int | torch.Tensor, int]:
    """Validate the checkpoint banks; return them with ``commit_n`` and ``Kc - 1``."""
    ck = _present("checkpoints", checkpoints, 6)
    cap = _present("captured", captured, 4)
    if ck.dtype != torch.float32:
        raise RollbackBoundsError(f"'checkpoints' must be torch.float32 (got {ck.dtype})")
    L, B, S = ck.shape[:3]
    if tuple(cap.shape[:2]) != (L, B):
        raise RollbackBoundsError(
            f"'captured' must have [L, B] = {(L, B)} leading dims like 'checkpoints' "
            f"(got {tuple(cap.shape[:2])})"
        )
    Kc1 = cap.shape[2] - S
    if Kc1 < 1:
        raise RollbackBoundsError(
            f"'captured' must have Kc-1+S rows with Kc >= 2 and S={S} (got {cap.shape[2]})"
        )
    if cap.device != ck.device:
        raise RollbackBoundsError(
            f"'captured' is on {cap.device} but 'checkpoints' is on {ck.device}"
        )
    return ck, cap, _commit(commit_n, S), Kc1


def rollback_restore(
    states: torch.Tensor,
    conv_rows: torch.Tensor,
    checkpoints: torch.Tensor,
    captured: torch.Tensor,
    commit_n: int | torch.Tensor,
    *,
    rows_only: bool = False,
    backend: checks.Backend = "auto",
) -> None:
    """Restore all ``L`` recurrent layers of a shard to the state after ``commit_n`` tokens.

    ``states[l] <- checkpoints[l, :, commit_n-1]`` and
    ``conv_rows[l] <- captured[l, :, commit_n : commit_n+Kc-1]`` for every layer, in one
    Triton launch (Triton on CUDA, or on CPU under ``TRITON_INTERPRET=1``; torch copies
    otherwise). Every check runs on the host before the launch, so a refused rollback has
    changed nothing.

    Args:
        states: ``[L, B, HV, K, V]`` float32, the live recurrent states.
        conv_rows: ``[L, B, Kc-1, C]`` the live conv windows.
        checkpoints: ``[L, B, S, HV, K, V]`` float32, written by ``gdn_verify``.
        captured: ``[L, B, Kc-1+S, C]`` written by ``causal_conv1d_capture``.
        commit_n: accepted tokens, ``1 <= commit_n <= S``: a host int, or a one-element
            int64 tensor on the storage's device that the kernel reads (so the launch needs
            no host value and a CUDA graph can hold it). A tensor's range is not checked on
            the host (that would synchronise); the copy clamps it to ``1 .. S``, and the
            caller checks the value it read back.
        rows_only: copy only the conv rows (a remap: the states stay in their slot).
        backend: ``"auto"``, ``"triton"`` or ``"reference"``.

    Raises:
        RollbackBoundsError: ``commit_n`` out of range, storage missing, not float32,
            shapes or devices disagree, or (Triton) an inner block not contiguous.
    """
    ck, cap, n, Kc1 = _check_storage(checkpoints, captured, commit_n)
    st = _present("states", states, 5)
    rows = _present("conv_rows", conv_rows, 4)
    L, B, S, HV, K, V = ck.shape
    C = cap.shape[3]
    if cap.shape[2] != rows.shape[2] + S:
        raise RollbackBoundsError(
            f"'conv_rows' and 'captured' disagree on Kc-1: 'conv_rows' has {rows.shape[2]} "
            f"rows, 'captured' has {cap.shape[2]} = Kc-1+S rows with S={S} from "
            f"'checkpoints' (Kc-1={cap.shape[2] - S})"
        )
    if st.dtype != torch.float32:
        raise RollbackBoundsError(f"'states' must be torch.float32 (got {st.dtype})")
    if tuple(st.shape) != (L, B, HV, K, V):
        raise RollbackBoundsError(
            f"'states' must have shape [L, B, HV, K, V] = {(L, B, HV, K, V)} from "
            f"'checkpoints' (got {tuple(st.shape)})"
        )
    if tuple(rows.shape) != (L, B, Kc1, C):
        raise RollbackBoundsError(
            f"'conv_rows' must have shape [L, B, Kc-1, C] = {(L, B, Kc1, C)} from "
            f"'captured' (got {tuple(rows.shape)})"
        )
    if rows.dtype != cap.dtype:
        raise RollbackBoundsError(
            f"'conv_rows' dtype {rows.dtype} must equal 'captured' dtype {cap.dtype}"
        )
    for name, t in (("states", st), ("conv_rows", rows)):
        if t.device != ck.device:
            raise RollbackBoundsError(
                f"'{name}' is on {t.device} but 'checkpoints' is on {ck.device}"
            )

    if isinstance(n, torch.Tensor) and n.device != ck.device:
        raise RollbackBoundsError(
            f"'commit_n' is on {n.device} but 'checkpoints' is on {ck.device}"
        )
    if not checks.use_triton(backend, ck.device):
        rollback_restore_reference(st, rows, ck, cap, n, rows_only=rows_only)
        return
    inner = (
        ("states", st, 2, (K * V, V, 1)), ("checkpoints", ck, 3, (K * V, V, 1)),
        ("conv_rows", rows, 2, (C, 1)), ("captured", cap, 2, (C, 1)),
    )
    for name, t, first, strides in inner:
        if t.stride()[first:] != strides and t[0, 0].numel() > 1:
            raise RollbackBoundsError(
                f"'{name}' must be contiguous after its [L, B] dims for the one-launch copy "
                f"(strides {t.stride()})"
            )
    from dflash.kernels.rollback_triton import launch_rollback_restore

    launch_rollback_restore(st, rows, ck, cap, n, rows_only=rows_only)
