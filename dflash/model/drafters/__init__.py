"""Drafters: guess ``block_size - 1`` tokens after the pending token (see ``base``).

- :class:`DFlashDrafter` — z-lab's DFlash block drafter (their checkpoint format), conditioned
  on target tap features through a cached context;
- :class:`PromptLookupDrafter` — n-gram lookup in the context;
- :class:`LookupAssistedDrafter` — a DFlash drafter whose draft is a context copy when the
  copy starts with its own first guess (``--draft dflash+lookup``);
- :class:`SyntheticDrafter` — SYNTHETIC, for benchmarks: a chosen acceptance profile
  against the target's own greedy continuation.
"""

from dflash.model.drafters.base import (
    DeviceCandidateDrafter,
    DeviceDrafter,
    Drafter,
    RevisingDrafter,
    ScoredDrafter,
    stack_tap_features,
)
from dflash.model.drafters.dflash2_drafter import DFlash2Drafter
from dflash.model.drafters.dflash_config import DFlash2Config, DFlashConfig, default_tap_layers
from dflash.model.drafters.dflash_drafter import DFlashDrafter
from dflash.model.drafters.errors import (
    CheckpointConfigError,
    CheckpointFileError,
    ConfigFieldError,
    DraftArgumentError,
    DrafterCheckpointError,
    DrafterError,
    DrafterFormatNotBuiltError,
    MaskTokenRangeError,
    MissingKeysError,
    OracleMismatchError,
    TapLayerRangeError,
    TargetMismatchError,
    TargetShapeMismatchError,
    TensorShapeError,
    UnexpectedKeysError,
    UnknownArchitectureError,
    UnknownDrafterSpecError,
)
from dflash.model.drafters.lookup_assisted import LookupAssistedDrafter
from dflash.model.drafters.prompt_lookup import LookupResult, PromptLookupDrafter
from dflash.model.drafters.registry import (
    DRAFTER_NAMES,
    LOOKUP_SUFFIX,
    DraftTarget,
    make_drafter,
)
from dflash.model.drafters.synthetic import AcceptanceProfile, Oracle, SyntheticDrafter

__all__ = [
    "DRAFTER_NAMES",
    "LOOKUP_SUFFIX",
    "AcceptanceProfile",
    "CheckpointConfigError",
    "CheckpointFileError",
    "ConfigFieldError",
    "DFlash2Config",
    "DFlash2Drafter",
    "DFlashConfig",
    "DFlashDrafter",
    "DeviceCandidateDrafter",
    "DeviceDrafter",
    "DraftArgumentError",
    "DraftTarget",
    "Drafter",
    "DrafterCheckpointError",
    "DrafterError",
    "DrafterFormatNotBuiltError",
    "LookupAssistedDrafter",
    "LookupResult",
    "MaskTokenRangeError",
    "MissingKeysError",
    "Oracle",
    "OracleMismatchError",
    "PromptLookupDrafter",
    "RevisingDrafter",
    "ScoredDrafter",
    "SyntheticDrafter",
    "TapLayerRangeError",
    "TargetMismatchError",
    "TargetShapeMismatchError",
    "TensorShapeError",
    "UnexpectedKeysError",
    "UnknownArchitectureError",
    "UnknownDrafterSpecError",
    "default_tap_layers",
    "make_drafter",
    "stack_tap_features",
]
