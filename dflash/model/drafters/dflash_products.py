"""What the DFlash drafter and its drafting parts share, so the parts need not import the
drafter: the product dtype (``draft_dtype``: its allowed values and the decorator that
runs a drafting method's products in it) and :class:`DrafterWeights`, what the parts on
the host (:mod:`dflash_host`) and on the device (:mod:`dflash_device`) use of the drafter
(:mod:`dflash_drafter`). See :func:`dflash_layers.products_in` for what the dtype governs.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from typing import Concatenate, ParamSpec, Protocol, TypeVar

import torch
from torch import Tensor

from dflash.model.drafters.dflash_config import DFlashConfig
from dflash.model.drafters.dflash_layers import (
    DrafterLayer,
    ProductLinear,
    RMSNorm,
    Rotary,
    products_in,
)
from dflash.model.drafters.errors import DraftArgumentError
from dflash.sampling import SamplingParams

ContextKV = list[tuple[Tensor, Tensor]]  # per layer: k, v [N, kv_heads, C, D]


class DrafterWeights(Protocol):
    """The drafter's weights and forward pieces, as its drafting parts use them
    (:class:`~dflash.model.drafters.dflash_drafter.DFlashDrafter` is one)."""

    config: DFlashConfig
    fc: ProductLinear
    hidden_norm: RMSNorm
    norm: RMSNorm
    rotary: Rotary
    _lm_head_weight: Tensor
    packs_layers: bool

    @property
    def dtype(self) -> torch.dtype: ...

    @property
    def device(self) -> torch.device: ...

    @property
    def draft_dtype(self) -> torch.dtype | None: ...

    @property
    def context_reach(self) -> int | None: ...

    def embed(self, ids: Tensor) -> Tensor: ...

    def project_context(self, features: Tensor) -> Tensor: ...

    def context_kv(self, context: Tensor, positions: Tensor) -> ContextKV: ...

    def run_block(
        self, x: Tensor, q_pos: Tensor, ctx_kv: ContextKV, k_ctx_pos: Tensor,
        extra_visible: Tensor | None = None,
    ) -> Tensor: ...

    def logits(self, hidden: Tensor) -> Tensor: ...

    def select(self, hidden: Tensor, logits: Tensor, last: int | Tensor, start: int | Tensor,
               sampling: SamplingParams) -> Tensor | None: ...

    def block_ids(self, last: int, block_size: int) -> Tensor: ...

    def _head_in(self, dtype: torch.dtype) -> Tensor: ...

    def _layers(self) -> list[DrafterLayer]: ...

    def _check_features(self, features: Tensor | None, n_context: int) -> Tensor: ...


class DraftingPart:
    """A drafting part (host or device) of one drafter: holds it, and reads its
    ``draft_dtype`` for :func:`drafting`."""

    def __init__(self, drafter: DrafterWeights) -> None:
        # a weak reference: the drafter owns this part, and a strong one back would make a
        # reference cycle, keeping the target's embedding and LM head (which the drafter
        # holds) alive until the garbage collector next runs
        self._drafter = weakref.ref(drafter)

    @property
    def drafter(self) -> DrafterWeights:
        drafter = self._drafter()
        if drafter is None:
            raise ReferenceError(f"the DFlash drafter of this {type(self).__name__} is gone")
        return drafter

    @property
    def draft_dtype(self) -> torch.dtype | None:
        """The drafter's ``draft_dtype`` (what :func:`drafting` runs the products in)."""
        return self.drafter.draft_dtype


#: the dtypes a drafter's products may run in (``draft_dtype``)
DRAFT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


class _Drafting(Protocol):
    """What :func:`drafting` reads: the products' dtype (None: each weight's own)."""

    @property
    def draft_dtype(self) -> torch.dtype | None: ...


_S = TypeVar("_S", bound=_Drafting)
_P = ParamSpec("_P")
_R = TypeVar("_R")


def check_draft_dtype(draft_dtype: object) -> torch.dtype | None:
    """``draft_dtype`` itself when it is None or one of :data:`DRAFT_DTYPES`.

    Raises:
        DraftArgumentError: anything else (named in the message).
    """
    if draft_dtype is None:
        return None
    if isinstance(draft_dtype, torch.dtype) and draft_dtype in DRAFT_DTYPES:
        return draft_dtype
    allowed = ", ".join(str(d) for d in DRAFT_DTYPES)
    raise DraftArgumentError(
        f"'draft_dtype' must be None (the drafter's own dtype) or one of {allowed} "
        f"(got {draft_dtype!r})"
    )


def drafting(method: Callable[Concatenate[_S, _P], _R]) -> Callable[Concatenate[_S, _P], _R]:
    """Run a drafting method with its products in its owner's ``draft_dtype``."""

    def run(self: _S, /, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        with products_in(self.draft_dtype):
            return method(self, *args, **kwargs)

    functools.update_wrapper(run, method)  # the method's name and docstring
    return run
