"""Typed errors raised by the drafters; every message names the argument, rule and value."""

from __future__ import annotations


class DrafterError(ValueError):
    """Base class of every error raised by :mod:`dflash.model.drafters`."""


class DraftArgumentError(DrafterError):
    """A drafter was given a bad argument (block size, probability, token id, features...)."""


class UnknownDrafterSpecError(DrafterError):
    """``make_drafter`` was given a spec that names no drafter and no existing directory."""


class OracleMismatchError(DrafterError):
    """The synthetic drafter's oracle disagrees with the tokens it was asked to continue."""


class DrafterCheckpointError(DrafterError):
    """A DFlash drafter checkpoint cannot be used; nothing from it has been loaded."""


class CheckpointFileError(DrafterCheckpointError):
    """A checkpoint file is missing, unreadable, truncated or corrupt."""


class CheckpointConfigError(DrafterCheckpointError):
    """A checkpoint's ``config.json`` is not a valid DFlash drafter configuration."""


class MissingKeysError(DrafterCheckpointError):
    """The checkpoint lacks tensors the drafter needs."""

    def __init__(self, path: str, keys: list[str]) -> None:
        self.keys = keys
        super().__init__(f"{path}: missing tensors {keys} (the drafter needs every one of them)")


class UnexpectedKeysError(DrafterCheckpointError):
    """The checkpoint holds tensors the drafter does not have."""

    def __init__(self, path: str, keys: list[str]) -> None:
        self.keys = keys
        super().__init__(f"{path}: unexpected tensors {keys} (the drafter has no such parameter)")


class TensorShapeError(DrafterCheckpointError):
    """A checkpoint tensor's shape differs from the one the configuration implies."""

    def __init__(self, path: str, key: str, expected: tuple[int, ...], found: tuple[int, ...]):
        self.key = key
        self.expected = expected
        self.found = found
        super().__init__(
            f"{path}: tensor {key!r} has shape {list(found)}, the config implies {list(expected)}"
        )


class TargetMismatchError(DrafterError):
    """The target embedding / LM head passed to a drafter disagree with its configuration."""
