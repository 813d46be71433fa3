"""Memory a model needs, checked against what the device has before any weight is built.

The estimate counts the weights (every parameter once, a tied LM head once) in the chosen
dtype plus one float32 copy of the largest tensor (seeded weights are drawn in float32 and
cast; loaded ones are read and then copied). The caches come on top, and are checked
when they are sized (:mod:`dflash.execution.memory`, before any is allocated).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dflash.execution.memory import InsufficientMemoryError, available_bytes, size_text

if TYPE_CHECKING:
    import torch

    from dflash.model import HybridConfig
    from dflash.model.fp8 import Fp8Spec


def weight_bytes(
    config: HybridConfig, dtype: torch.dtype, quantization: Fp8Spec | None = None
) -> tuple[int, int]:
    """``(parameters, bytes needed)`` for a model of ``config`` in ``dtype`` (its quantized
    projections one byte each, with their float32 scales, for an FP8 checkpoint)."""
    import torch

    from dflash.model import TargetModel
    from dflash.model.fp8 import FP8, replace_linears_

    with torch.device("meta"):  # shapes only: nothing is allocated
        model = TargetModel(config)
        if quantization is not None:
            replace_linears_(model, quantization, quantize=False)
    weights = list(model.parameters())
    params = sum(p.numel() for p in weights)
    size = sum(p.numel() * (1 if p.dtype == FP8 else dtype.itemsize) for p in weights)
    size += sum(b.numel() * b.element_size() for b in model.buffers())  # FP8 block scales
    return params, size + max(p.numel() for p in weights) * 4


def _count(n: int) -> str:
    return f"{n / 1e9:.2f} B" if n >= 10**8 else f"{n / 1e6:.2f} M"


def describe_need(name: str, params: int, need: int, dtype: torch.dtype) -> str:
    """``model 'x' has 8.95 B parameters and needs about 39.9 GB for its weights in …``."""
    dtype_name = str(dtype).replace("torch.", "")
    return (
        f"model {name!r} has {_count(params)} parameters and needs about {size_text(need)} for "
        f"its weights in {dtype_name}"
    )


def check_memory(
    name: str, config: HybridConfig, dtype: torch.dtype, device: str,
    quantization: Fp8Spec | None = None,
) -> None:
    """Raise :class:`InsufficientMemoryError` when ``config``'s weights cannot fit on ``device``."""
    free = available_bytes(device)
    if free is None:
        return
    params, need = weight_bytes(config, dtype, quantization)
    if need > free[0]:
        raise InsufficientMemoryError(
            f"{describe_need(name, params, need, dtype)}, but only {size_text(free[0])} is "
            f"free on {device} ({free[1]}); try --dtype bfloat16, a smaller --model, or a "
            "machine with more memory"
        )


__all__ = [
    "InsufficientMemoryError",
    "available_bytes",
    "check_memory",
    "describe_need",
    "weight_bytes",
]
