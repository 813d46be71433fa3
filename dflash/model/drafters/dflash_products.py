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


# -- a proposal's candidates per slot (what a tree grows from) -------------------------------


def ranked_top_k(values: Tensor, k: int) -> Tensor:
    """``values: [S, V]`` (finite) → ``[S, k]`` int64: each row's ``k`` largest entries'
    ids, by value descending, equal values by ascending id — what a stable descending
    sort puts first — in O(V) and without a host read (capture-safe; a sort of the
    vocabulary is many times slower): every id above the ``k``-th largest value, then the
    ids equal to it in ascending order (a float key: ids are exact in float32 below
    2**24), then those ``k`` ordered by value (two sorts of ``k`` entries)."""
    vocab = values.shape[-1]
    kth = values.topk(k, dim=-1).values[..., -1:]                                 # [S, 1]
    id_key = (vocab - torch.arange(vocab, device=values.device)).to(torch.float32)
    key = torch.where(values > kth, 2.0 * vocab, torch.where(values == kth, id_key, -1.0))
    ids = key.topk(k, dim=-1).indices.sort(dim=-1).values                         # by id
    order = values.gather(-1, ids).sort(dim=-1, descending=True, stable=True).indices
    return ids.gather(-1, order)


def slot_candidates(logits: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """A proposal's ``k`` most likely tokens per guess slot: ``logits [S, V]`` →
    ``(ids [S, k] int64, log_probs [S, k] float64)``, best first, equal log-probabilities
    by ascending id; the log-softmax in float64 (clamped to 0 above). The host's
    :meth:`HostDrafting.candidates` and the device's step compute them alike, so a tree
    grown from either is the same tree."""
    log_probs = torch.log_softmax(logits.double(), dim=-1)
    ids = ranked_top_k(log_probs, k)
    return ids, log_probs.gather(-1, ids).clamp(max=0.0)


def candidate_lists(ids: list[list[int]], log_probs: list[list[float]]
                    ) -> list[list[tuple[int, float]]]:
    """:func:`slot_candidates`' two tables, read to the host, as the per-slot
    ``(token, log_prob)`` lists :func:`~dflash.model.drafters.trees.best_first_tree`
    takes."""
    return [[(int(t), float(lp)) for t, lp in zip(row_ids, row_lps, strict=True)]
            for row_ids, row_lps in zip(ids, log_probs, strict=True)]
