"""Reading and writing DFlash drafter checkpoints: ``config.json`` + ``model.safetensors``.

Reading is all-or-nothing: the config is validated, every tensor's name, shape and dtype is
checked against the configuration and every tensor is read before any of them is handed
out, so a bad checkpoint raises a typed :class:`DrafterCheckpointError` and nothing
half-loaded is ever used. Files are memory-mapped by safetensors; nothing is unpickled.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import pydantic
from pydantic_core import ErrorDetails
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor

from dflash.model.drafters.dflash_config import DFlashConfig
from dflash.model.drafters.errors import (
    CheckpointConfigError,
    CheckpointFileError,
    DrafterCheckpointError,
    MissingKeysError,
    TensorShapeError,
    UnexpectedKeysError,
)

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"


def read_config(directory: str | Path) -> DFlashConfig:
    """Read and validate ``directory/config.json``."""
    root = Path(directory)
    if not root.is_dir():
        raise CheckpointFileError(f"drafter checkpoint {str(root)!r} is not a directory")
    path = root / CONFIG_FILE
    if not path.is_file():
        raise CheckpointFileError(f"drafter checkpoint {str(root)!r} has no {CONFIG_FILE}")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointConfigError(f"{path}: not readable JSON ({exc})") from exc
    if not isinstance(raw, dict):
        raise CheckpointConfigError(f"{path}: must hold a JSON object (got {type(raw).__name__})")
    try:
        return DFlashConfig.model_validate(raw)
    except pydantic.ValidationError as exc:
        problems = "; ".join(_describe(err) for err in exc.errors())
        raise CheckpointConfigError(f"{path}: invalid DFlash drafter config: {problems}") from exc


def _describe(err: ErrorDetails) -> str:
    """``field: rule (got value)``; a missing field or a cross-field rule has no value."""
    where = ".".join(str(p) for p in err["loc"]) or "<config>"
    shown = err["loc"] and err["type"] != "missing"
    return f"{where}: {err['msg']}" + (f" (got {err['input']!r})" if shown else "")


def read_weights(
    directory: str | Path, expected_shapes: Mapping[str, tuple[int, ...]]
) -> dict[str, Tensor]:
    """Read ``directory/model.safetensors`` after checking names and shapes.

    Raises (in this order): :class:`CheckpointFileError` (missing/unreadable/corrupt file),
    :class:`MissingKeysError`, :class:`UnexpectedKeysError`, :class:`TensorShapeError`,
    :class:`DrafterCheckpointError` (a tensor that is not floating point).
    """
    path = Path(directory) / WEIGHTS_FILE
    if not path.is_file():
        raise CheckpointFileError(f"drafter checkpoint {str(directory)!r} has no {WEIGHTS_FILE}")
    shown = str(path)
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            keys = set(f.keys())
            missing = sorted(set(expected_shapes) - keys)
            if missing:
                raise MissingKeysError(shown, missing)
            unexpected = sorted(keys - set(expected_shapes))
            if unexpected:
                raise UnexpectedKeysError(shown, unexpected)
            for key in sorted(keys):
                found = tuple(int(n) for n in f.get_slice(key).get_shape())
                if found != expected_shapes[key]:
                    raise TensorShapeError(shown, key, expected_shapes[key], found)
            tensors: dict[str, Tensor] = {key: f.get_tensor(key) for key in sorted(keys)}
    except DrafterCheckpointError:
        raise
    except Exception as exc:  # safetensors reports corruption with its own (untyped) errors
        raise CheckpointFileError(
            f"{shown}: unreadable safetensors file ({type(exc).__name__}: {exc})"
        ) from exc
    for key, tensor in tensors.items():
        if not tensor.is_floating_point():
            raise DrafterCheckpointError(
                f"{shown}: tensor {key!r} has dtype {tensor.dtype}, "
                f"a floating-point dtype is required"
            )
    return tensors


def write_checkpoint(
    directory: str | Path, config: DFlashConfig, tensors: Mapping[str, Tensor]
) -> None:
    """Write ``config.json`` and ``model.safetensors`` (tensors copied to contiguous CPU)."""
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    (root / CONFIG_FILE).write_text(config.model_dump_json(indent=2) + "\n", encoding="utf-8")
    cpu = {key: t.detach().to("cpu").contiguous() for key, t in tensors.items()}
    save_file(cpu, str(root / WEIGHTS_FILE), metadata={"format": "pt"})


__all__ = ["CONFIG_FILE", "WEIGHTS_FILE", "read_config", "read_weights", "write_checkpoint"]
