"""End-of-sequence ids: what a generation stops at (no torch needed).

A checkpoint may name one EOS id or several (``generation_config.json``'s
``eos_token_id`` list: Qwen's instruct models name the turn's end and the text's); a
generation stops at the first token that is any of them.
"""

from __future__ import annotations

from collections.abc import Sequence

#: what generation stops at: a token id, several (any of them), or None (no EOS)
Eos = int | Sequence[int] | None


def eos_ids(eos: Eos) -> tuple[int, ...]:
    """The ids an :data:`Eos` names, in order, once each (empty: none)."""
    if eos is None:
        return ()
    if isinstance(eos, int):
        return (eos,)
    return tuple(dict.fromkeys(eos))


def eos_set(eos: Eos) -> frozenset[int]:
    """The ids an :data:`Eos` names, as a set (empty: none)."""
    return frozenset(eos_ids(eos))


def before_eos(tokens: Sequence[int], eos: frozenset[int]) -> list[int]:
    """``tokens`` before the first of ``eos`` (all of them when none is there): the ones
    that are text."""
    cut = cut_at_eos(tokens, eos)
    return list(tokens) if cut is None else cut[:-1]


def cut_at_eos(tokens: Sequence[int], eos: frozenset[int]) -> list[int] | None:
    """``tokens`` up to and including the first of ``eos``, or None when none is there."""
    for i, t in enumerate(tokens):
        if t in eos:
            return list(tokens[: i + 1])
    return None
