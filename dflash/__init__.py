"""dflash: lossless speculative decoding for hybrid recurrent/attention models.

The verification path is guarded in two layers: :mod:`dflash.geometry` rejects every
malformed draft geometry before any kernel runs, and :mod:`dflash.execution` enables
fast recurrent-state rollback only after capture validation has succeeded, falling
back fail-closed to snapshot + replay otherwise.
"""

__version__ = "0.1.0"
