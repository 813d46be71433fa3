"""Package data: the embedded default pair (a trained target and its DFlash drafter).

Layout (rebuilt by ``scripts/build_default.py``)::

    dflash/data/default/target/    config.json, model.safetensors (or a sharded index),
                                   tokenizer.json, generation_config.json
    dflash/data/default/drafter/   config.json, model.safetensors (z-lab DFlash format)

``DFLASH_DATA_DIR`` points the lookup at another directory holding ``default/`` (for a
pair rebuilt locally). A missing pair raises :class:`DefaultDataMissingError`, which names
the directory and how to get the files.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

from dflash.errors import CheckpointError

ENV_VAR = "DFLASH_DATA_DIR"
PairPart = Literal["target", "drafter"]
# the files each part needs (a sharded checkpoint replaces model.safetensors by its index)
REQUIRED_FILES: dict[PairPart, tuple[str, ...]] = {
    "target": ("config.json", "tokenizer.json", "generation_config.json"),
    "drafter": ("config.json",),
}
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")


class DefaultDataMissingError(CheckpointError, FileNotFoundError):
    """The embedded default pair (or one of its files) is not installed."""


def data_root() -> Path:
    """The directory that holds ``default/`` (``$DFLASH_DATA_DIR``, else this package)."""
    override = os.environ.get(ENV_VAR)
    return Path(override) if override else Path(__file__).resolve().parent


def default_dir(part: PairPart) -> Path:
    """Where the default pair's ``part`` lives (it may be absent; see :func:`require_default`)."""
    return data_root() / "default" / part


def missing_files(part: PairPart) -> list[str]:
    """The files of ``part`` that are absent (empty when it is installed)."""
    directory = default_dir(part)
    missing = [name for name in REQUIRED_FILES[part] if not (directory / name).is_file()]
    if not any((directory / name).is_file() for name in WEIGHT_FILES):
        missing.append(WEIGHT_FILES[0])
    return missing


def require_default(part: PairPart) -> Path:
    """The directory of the default pair's ``part``; raises when a file is missing."""
    directory = default_dir(part)
    missing = missing_files(part)
    if missing:
        where = f"${ENV_VAR}={os.environ[ENV_VAR]}" if os.environ.get(ENV_VAR) else "the package"
        raise DefaultDataMissingError(
            f"the default {part} is not installed: {str(directory)!r} lacks "
            f"{', '.join(missing)} (looked in {where}). Rebuild the pair with "
            "scripts/build_default.py and install it with --install-from, or use a seeded "
            "model such as --model tiny"
        )
    return directory


def default_available() -> bool:
    """True when both parts of the default pair are installed."""
    return not missing_files("target") and not missing_files("drafter")
