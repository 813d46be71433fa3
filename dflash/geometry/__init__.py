"""Draft-geometry validation (public API): pure Python, imports no torch.

Every input maps to a validated geometry or a typed :class:`Rejection`; the validators
never raise. :class:`ChainGeometry` / :class:`TreeGeometry` can only be built by the
validators, so kernels and models that accept only these types run only on validated
geometry. ``specs/geometry.md`` is the specification.
"""

from dflash.geometry.inputs import decode_int32_le
from dflash.geometry.reasons import GeometryError, Rejection, RejectReason
from dflash.geometry.validate import (
    Verdict,
    require_chain,
    require_tree,
    run_if_root_inclusive_pure_chain,
    validate_chain,
    validate_tree,
    verdict_from_dict,
    verdict_from_json,
)
from dflash.geometry.values import MAX_SLOTS, ChainGeometry, TreeGeometry

__all__ = [
    "MAX_SLOTS",
    "ChainGeometry",
    "GeometryError",
    "RejectReason",
    "Rejection",
    "TreeGeometry",
    "Verdict",
    "decode_int32_le",
    "require_chain",
    "require_tree",
    "run_if_root_inclusive_pure_chain",
    "validate_chain",
    "validate_tree",
    "verdict_from_dict",
    "verdict_from_json",
]
