"""Typed errors raised by the drafters; every message names the argument, rule and value.

Each family also derives from its layer in :mod:`dflash.errors`: bad arguments and specs
are ``UsageError`` s, checkpoint problems ``CheckpointError`` s (one family with the target
model's checkpoint errors), a target that disagrees with the drafter a ``ConfigError``.
"""

from __future__ import annotations

from dflash.errors import CheckpointError, ConfigError, DFlashError, UsageError


class _Missing:
    """The value shown for a ``config.json`` field that is absent."""

    def __repr__(self) -> str:
        return "<missing>"


MISSING = _Missing()


class DrafterError(DFlashError, ValueError):
    """Base class of every error raised by :mod:`dflash.model.drafters`."""


class DraftArgumentError(DrafterError, UsageError):
    """A drafter was given a bad argument (block size, probability, token id, features...)."""


class UnknownDrafterSpecError(DrafterError, UsageError):
    """``make_drafter`` was given a spec that names no drafter and no existing directory."""


class OracleMismatchError(DrafterError, UsageError):
    """The synthetic drafter's oracle disagrees with the tokens it was asked to continue."""


class DrafterFormatNotBuiltError(DrafterError, UsageError):
    """A drafter asked for what its format does not give: a DFlash2 drafter's independent
    per-slot candidates (its slots depend on each other: its trees come from its
    selector)."""


class DrafterCheckpointError(DrafterError, CheckpointError):
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


class ConfigFieldError(CheckpointConfigError):
    """One ``config.json`` field is missing, of the wrong type or out of range."""

    def __init__(self, path: str, field: str, expected: str, found: object) -> None:
        self.field = field
        self.expected = expected
        self.found = found
        shown = "<missing>" if found is MISSING else repr(found)
        super().__init__(f"{path}: field {field!r}: expected {expected}, found {shown}")


class UnknownArchitectureError(ConfigFieldError):
    """``config.json`` names another architecture / model type than z-lab's DFlash drafter."""


class TargetMismatchError(DrafterError, ConfigError):
    """The target passed to a drafter disagrees with the drafter's configuration."""


class TargetShapeMismatchError(TargetMismatchError):
    """Hidden size or vocabulary of the drafter and of the target differ."""

    def __init__(self, where: str, field: str, drafter: int, target: int) -> None:
        self.field = field
        self.drafter_value = drafter
        self.target_value = target
        super().__init__(
            f"{where}: {field} is {drafter} in the drafter config, the target has {target}"
        )


class TapLayerRangeError(TargetMismatchError):
    """A tap layer (``target_layer_ids``) does not exist in the target."""


class MaskTokenRangeError(ConfigFieldError):
    """``dflash_config.mask_token_id`` is not a token of the (target's) vocabulary."""
