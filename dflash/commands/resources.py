"""Memory a model needs, checked against what the device has before any weight is built.

The estimate counts the weights (every parameter once, a tied LM head once) in the chosen
dtype plus one float32 copy of the largest tensor (seeded weights are drawn in float32 and
cast; loaded ones are read and then copied). Caches and checkpoint storage come on top,
so a model that passes can still run out of memory later; one that fails cannot fit.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import TYPE_CHECKING

from dflash.errors import ExecutionError

if TYPE_CHECKING:
    import torch

    from dflash.model import HybridConfig

GB = 10**9


class InsufficientMemoryError(ExecutionError):
    """The model does not fit on its device; the message names its size and the free memory."""


def weight_bytes(config: HybridConfig, dtype: torch.dtype) -> tuple[int, int]:
    """``(parameters, bytes needed)`` for a model of ``config`` in ``dtype``."""
    import torch

    from dflash.model import TargetModel

    with torch.device("meta"):  # shapes only: nothing is allocated
        model = TargetModel(config)
    sizes = [p.numel() for p in model.parameters()]
    params = sum(sizes)
    return params, params * dtype.itemsize + max(sizes) * 4


def available_bytes(device: str) -> tuple[int, str] | None:
    """Free memory on ``device`` and where the number comes from (None: unknown)."""
    if device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            return None
        free, _total = torch.cuda.mem_get_info(torch.device(device))
        return int(free), "torch.cuda.mem_get_info"
    try:  # psutil is optional: used when installed, else Linux's /proc/meminfo
        psutil = importlib.import_module("psutil")
        return int(psutil.virtual_memory().available), "psutil available memory"
    except ImportError:
        pass
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024, "MemAvailable in /proc/meminfo"
    except (OSError, ValueError, IndexError):
        return None
    return None


def _count(n: int) -> str:
    return f"{n / 1e9:.2f} B" if n >= 10**8 else f"{n / 1e6:.2f} M"


def _size(n: int) -> str:
    return f"{n / GB:.1f} GB" if n >= 10**8 else f"{n / 1e6:.1f} MB"


def describe_need(name: str, params: int, need: int, dtype: torch.dtype) -> str:
    """``model 'x' has 8.95 B parameters and needs about 39.9 GB for its weights in …``."""
    dtype_name = str(dtype).replace("torch.", "")
    return (
        f"model {name!r} has {_count(params)} parameters and needs about {_size(need)} for "
        f"its weights in {dtype_name}"
    )


def check_memory(name: str, config: HybridConfig, dtype: torch.dtype, device: str) -> None:
    """Raise :class:`InsufficientMemoryError` when ``config``'s weights cannot fit on ``device``."""
    free = available_bytes(device)
    if free is None:
        return
    params, need = weight_bytes(config, dtype)
    if need > free[0]:
        raise InsufficientMemoryError(
            f"{describe_need(name, params, need, dtype)}, but only {_size(free[0])} is "
            f"free on {device} ({free[1]}); try --dtype bfloat16, a smaller --model, or a "
            "machine with more memory"
        )
