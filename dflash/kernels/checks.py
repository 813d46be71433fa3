"""Input checks shared by the kernel entry points, and the backend choice.

Every public kernel validates its arguments here *before* anything is launched, so bad
input surfaces as a ``TypeError`` (not a tensor, not a geometry) or a
:class:`~dflash.errors.KernelBoundsError` (a ``ValueError``: shape, dtype, device, layout)
that names the argument, the rule and the value, never as an error from inside a kernel.
"""

from __future__ import annotations

import os
from typing import Literal

import torch

from dflash.errors import KernelBoundsError
from dflash.geometry import ChainGeometry, TreeGeometry

Backend = Literal["auto", "triton", "reference"]

#: Triton reads TRITON_INTERPRET when a kernel is decorated (at import), so the choice of
#: running Triton on CPU tensors is fixed when this module is first imported.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def tensor(name: str, value: object, ndim: int) -> torch.Tensor:
    """Return ``value`` if it is a floating tensor of rank ``ndim``, else raise naming it."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"'{name}' must be a torch.Tensor (got {type(value).__name__})")
    if value.ndim != ndim:
        raise KernelBoundsError(
            f"'{name}' must have {ndim} dimensions (got shape {tuple(value.shape)})"
        )
    if value.dtype not in FLOAT_DTYPES:
        raise KernelBoundsError(f"'{name}' must be a floating tensor (got dtype {value.dtype})")
    return value


def rows(name: str, value: object) -> torch.Tensor:
    """Return ``value`` if it is a floating tensor of rank >= 1 (rows of its last dimension,
    any leading shape), else raise naming it."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"'{name}' must be a torch.Tensor (got {type(value).__name__})")
    if value.ndim < 1 or value.dtype not in FLOAT_DTYPES:
        raise KernelBoundsError(
            f"'{name}' must be a floating tensor of rank >= 1 "
            f"(got {value.dtype}, {tuple(value.shape)})"
        )
    return value


def shape(name: str, value: torch.Tensor, expected: tuple[int, ...], what: str) -> None:
    if tuple(value.shape) != expected:
        raise KernelBoundsError(
            f"'{name}' must have shape {what} = {expected} (got {tuple(value.shape)})"
        )


def dtype(name: str, value: torch.Tensor, expected: torch.dtype) -> None:
    if value.dtype != expected:
        raise KernelBoundsError(f"'{name}' must be {expected} (got {value.dtype})")


def output(
    name: str, value: object, expected: tuple[int, ...], dtype: torch.dtype, what: str
) -> torch.Tensor:
    """Check an ``out=`` tensor: exactly ``expected`` shape and ``dtype``, contiguous.

    The device is checked with the inputs (:func:`same_device`), overlap with
    :func:`disjoint`.
    """
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"'{name}' must be a torch.Tensor or None (got {type(value).__name__})")
    shape(name, value, expected, what)
    if value.dtype != dtype:
        raise KernelBoundsError(f"'{name}' must be {dtype} like the result (got {value.dtype})")
    if not value.is_contiguous():
        raise KernelBoundsError(
            f"'{name}' must be contiguous (got strides {value.stride()} for shape {expected})"
        )
    return value


def rows_view(name: str, t: torch.Tensor, width: int) -> torch.Tensor:
    """``t`` as a ``[R, width]`` view (unit stride along the last dimension, leading
    dimensions collapsed into one row stride; a column slice of a wider buffer qualifies),
    else :class:`KernelBoundsError` naming it."""
    if t.stride(-1) != 1 and t.shape[-1] > 1:
        raise KernelBoundsError(
            f"'{name}' must have a contiguous last dimension (got strides {t.stride()})"
        )
    try:
        return t.view(-1, width)
    except RuntimeError:
        raise KernelBoundsError(
            f"'{name}' leading dimensions must be collapsible into rows without a copy "
            f"(got shape {tuple(t.shape)}, strides {t.stride()})"
        ) from None


def device_index(name: str, value: object) -> torch.Tensor:
    """Return ``value`` if it is a one-element int64 tensor (an index the kernel reads on the
    device: checking its value here would synchronise with the device), else raise naming it."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"'{name}' must be a torch.Tensor (got {type(value).__name__})")
    if value.dtype != torch.int64 or value.numel() != 1:
        raise KernelBoundsError(
            f"'{name}' must be a one-element int64 tensor (got dtype {value.dtype}, "
            f"shape {tuple(value.shape)})"
        )
    return value


def tensor_of(name: str, value: object, ndim: int, dtype: torch.dtype) -> torch.Tensor:
    """Return ``value`` if it is a ``dtype`` tensor of rank ``ndim``, else raise naming it."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"'{name}' must be a torch.Tensor (got {type(value).__name__})")
    if value.dtype != dtype or value.ndim != ndim:
        raise KernelBoundsError(
            f"'{name}' must be a {ndim}-dimensional {dtype} tensor (got dtype {value.dtype}, "
            f"shape {tuple(value.shape)})"
        )
    return value


def index_vector(name: str, value: object) -> torch.Tensor:
    """Return ``value`` if it is a one-dimensional int64 tensor (indices a kernel reads),
    else raise naming it."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"'{name}' must be a torch.Tensor (got {type(value).__name__})")
    if value.dtype != torch.int64 or value.ndim != 1:
        raise KernelBoundsError(
            f"'{name}' must be a one-dimensional int64 tensor (got dtype {value.dtype}, "
            f"shape {tuple(value.shape)})"
        )
    return value


def disjoint(name: str, value: torch.Tensor, others: dict[str, torch.Tensor | None]) -> None:
    """``value`` (an output) shares no storage with any of ``others`` (inputs, other outputs)."""
    if value.numel() == 0:
        return
    mine = value.untyped_storage().data_ptr()
    for n, t in others.items():
        if t is not None and t.numel() and t.untyped_storage().data_ptr() == mine:
            raise KernelBoundsError(f"'{name}' must not share memory with '{n}'")


def same_device(named: dict[str, torch.Tensor | None]) -> torch.device:
    """All given tensors share one device; return it."""
    present = {n: t for n, t in named.items() if t is not None}
    first_name, first = next(iter(present.items()))
    for n, t in present.items():
        if t.device != first.device:
            raise KernelBoundsError(
                f"'{n}' is on {t.device} but '{first_name}' is on {first.device}; "
                "all tensors must share one device"
            )
    return first.device


def geometry_parents(geometry: object, T: int, final_state_only: bool) -> tuple[int, ...] | None:
    """The root-inclusive parent tuple of a validated geometry, or ``None`` for a chain.

    Only :class:`ChainGeometry` / :class:`TreeGeometry` are accepted (a plain list, a
    ``Rejection`` or anything else raises ``TypeError``). ``None`` is accepted only with
    ``final_state_only=True`` (prefill, decode, replay: a plain sequential run).
    """
    if geometry is None:
        if not final_state_only:
            raise TypeError(
                "'geometry' must be a ChainGeometry or TreeGeometry when capturing "
                "checkpoints (got None; only final_state_only=True runs without one)"
            )
        return None
    if not isinstance(geometry, (ChainGeometry, TreeGeometry)):
        raise TypeError(
            "'geometry' must be a validated ChainGeometry or TreeGeometry "
            f"(got {type(geometry).__name__})"
        )
    if geometry.n_actual != T:
        raise KernelBoundsError(
            f"'geometry' n_actual must equal the token count T={T} (got {geometry.n_actual})"
        )
    if isinstance(geometry, ChainGeometry):
        return None
    if final_state_only:
        raise KernelBoundsError(
            "'geometry' must be a chain with final_state_only=True (got a tree)"
        )
    chain = tuple(range(-1, T - 1))
    return None if geometry.parents == chain else tuple(geometry.parents)


def use_triton(backend: str, device: torch.device) -> bool:
    """Resolve ``backend`` for tensors on ``device``: True runs Triton, False the reference."""
    if backend == "reference":
        return False
    runnable = device.type == "cuda" or (device.type == "cpu" and INTERPRET)
    if backend == "auto":
        return runnable
    if backend == "triton":
        if not runnable:
            raise KernelBoundsError(
                f"backend='triton' needs CUDA tensors or TRITON_INTERPRET=1 (got {device})"
            )
        return True
    raise KernelBoundsError(f"'backend' must be 'auto', 'triton' or 'reference' (got {backend!r})")
