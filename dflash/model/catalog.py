"""Target models by name: the built-in names, checkpoint directories, building one.

- ``default``: the embedded trained pair's target, shipped as package data (see
  :mod:`dflash.data`);
- ``tiny`` (:meth:`TargetModel.tiny_default` shape), ``nine-b-shape`` and
  ``twenty-seven-b-shape`` (the shapes of Qwen3.5-9B and Qwen3.5-27B, for benchmarks):
  seeded random weights;
- anything else: a Hugging Face checkpoint directory. Names win over directories: write
  ``./tiny`` to load a directory of that name.

Messages name the parameter ``'model'``; the command line spells it ``--model``
(:meth:`dflash.errors.UsageError.worded`). Used by the library, the command line and
training alike; nothing here changes global torch settings.
"""

from __future__ import annotations

from pathlib import Path

import torch

from dflash.data import DefaultDataMissingError, require_default
from dflash.errors import UsageError, param
from dflash.model.config import HybridConfig
from dflash.model.fp8 import Fp8Spec
from dflash.model.target import TargetModel

DEFAULT_MODEL = "default"
SEEDED_MODELS = ("tiny", "nine-b-shape", "twenty-seven-b-shape")
BUILTIN_MODELS = (DEFAULT_MODEL, *SEEDED_MODELS)


class SessionError(UsageError):
    """A model, drafter, dtype or prompt argument that cannot be used; names the value."""


def model_directory(spec: str) -> Path | None:
    """The checkpoint directory ``spec`` names (None for a seeded model)."""
    if spec in SEEDED_MODELS:
        return None
    if spec == DEFAULT_MODEL:
        try:
            return require_default("target")
        except DefaultDataMissingError as exc:
            raise SessionError(f"{param('model')} default: {exc}") from None
    if spec and Path(spec).is_dir():
        return Path(spec)
    why = ("empty" if not spec else "a file, not a directory" if Path(spec).exists()
           else "no such directory")
    raise SessionError(
        f"{param('model')} must be one of {', '.join(BUILTIN_MODELS)} or a checkpoint "
        f"directory (got {spec!r}: {why})"
    )


def model_config(spec: str) -> HybridConfig:
    """The configuration of the model named by ``spec``, without building any weights."""
    if spec == "tiny":
        return HybridConfig.tiny_default()
    if spec == "nine-b-shape":
        return HybridConfig.nine_b_shape()
    if spec == "twenty-seven-b-shape":
        return HybridConfig.twenty_seven_b_shape()
    directory = model_directory(spec)
    assert directory is not None  # only seeded names have no directory
    return HybridConfig.from_hf_config(directory)


def model_quantization(spec: str) -> Fp8Spec | None:
    """The FP8 format of the checkpoint ``spec`` names (None: seeded, or not quantized);
    read from its ``config.json`` without building anything."""
    import json

    from dflash.model.fp8 import parse_fp8_config

    directory = model_directory(spec)
    if directory is None:
        return None
    path = directory / "config.json"
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None  # model_config reports the unreadable file
    if not isinstance(raw, dict):
        return None
    return parse_fp8_config(raw.get("quantization_config"), str(path))


def build_model(spec: str, *, seed: int, dtype: torch.dtype, device: str) -> TargetModel:
    """The target model named by ``spec`` on ``device`` (moved per shard later)."""
    directory = model_directory(spec)
    if directory is not None:
        return TargetModel.from_pretrained(directory, dtype=dtype, device=device)
    return TargetModel.seeded(model_config(spec), seed=seed, dtype=dtype, device=device)
