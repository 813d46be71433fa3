"""Training DFlash drafters for a frozen target (``dflash train-drafter``).

- :mod:`dflash.training.data` — token files / text with the target's tokenizer, and
  teacher sequences (the target's own greedy responses);
- :mod:`dflash.training.objective` — anchored blocks trained in one masked forward with
  position-decayed cross-entropy;
- :mod:`dflash.training.loop` — :func:`train_drafter`: optimizer, schedule, held-out τ
  measured with the real decoding engine, checkpoints in z-lab's format, resume.
"""

from dflash.training.data import DataError
from dflash.training.loop import TrainConfig, TrainResult, train_drafter
from dflash.training.objective import block_forward, block_loss, default_gamma, slot_weights

__all__ = [
    "DataError",
    "TrainConfig",
    "TrainResult",
    "block_forward",
    "block_loss",
    "default_gamma",
    "slot_weights",
    "train_drafter",
]
