"""SYNTHETIC drafter for benchmarks: a chosen acceptance profile, not a model.

It knows the target's own greedy continuation (the *oracle*) and proposes, slot by slot,
the oracle's token with probability ``p_i`` (slot ``i`` = 1..B-1, conditional on every
earlier slot having been proposed correctly) and otherwise a token guaranteed to differ
from the oracle's. After the first wrong slot the rest of the block is arbitrary (random
tokens), since verification stops there. Against a target whose greedy output is the
oracle, slot ``i`` is therefore accepted with probability ``p_i`` given the earlier ones
were — the acceptance profile is an input, which makes rollback costs measurable at any
acceptance rate. Results that use it must say so: its ``label`` is ``"synthetic"`` and its
:class:`AcceptanceProfile` carries the same label.

Randomness is a pure function of ``(seed, len(context))``: the same call gives the same
proposal regardless of call history, and different positions draw independently.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import Literal

from pydantic import BaseModel, ConfigDict, computed_field
from torch import Tensor

from dflash.model.drafters.base import check_block_size, check_context, check_token
from dflash.model.drafters.errors import DraftArgumentError, OracleMismatchError

# The oracle: the full greedy sequence (prompt + continuation) computed up front, or a
# callable returning the target's greedy next token after a prefix.
Oracle = Sequence[int] | Callable[[list[int]], int]


class AcceptanceProfile(BaseModel):
    """What a synthetic drafter proposed so far (``label`` says it is synthetic).

    ``attempts[i]``: blocks in which slot ``i+1`` was drawn with every earlier slot correct;
    ``accepted[i]``: of those, how many proposed the oracle's token. Slots past the end of
    a sequence oracle are not counted (``beyond_oracle`` counts them).
    """

    model_config = ConfigDict(frozen=True)

    label: Literal["synthetic"] = "synthetic"
    note: str = "synthetic drafter: acceptance is chosen by configuration, not measured"
    probabilities: tuple[float, ...]
    attempts: tuple[int, ...]
    accepted: tuple[int, ...]
    beyond_oracle: int

    @computed_field  # type: ignore[prop-decorator]  # pydantic's documented property pattern
    @property
    def rates(self) -> tuple[float | None, ...]:
        """Achieved conditional acceptance per slot (``None`` where never attempted)."""
        return tuple(
            a / n if n else None for a, n in zip(self.accepted, self.attempts, strict=True)
        )

    @computed_field  # type: ignore[prop-decorator]  # pydantic's documented property pattern
    @property
    def per_token_rate(self) -> float | None:
        """Pooled achieved acceptance over every attempted slot."""
        total = sum(self.attempts)
        return sum(self.accepted) / total if total else None

    @computed_field  # type: ignore[prop-decorator]  # pydantic's documented property pattern
    @property
    def mean_accepted(self) -> float | None:
        """Average number of correctly proposed draft tokens per block."""
        blocks = self.attempts[0] if self.attempts else 0
        return sum(self.accepted) / blocks if blocks else None


class SyntheticDrafter:
    """SYNTHETIC benchmark drafter with a chosen acceptance profile (see module docstring)."""

    label = "synthetic"
    tap_layers: tuple[int, ...] = ()

    def __init__(self, oracle: Oracle, acceptance: float, vocab_size: int, seed: int = 0):
        """Constant per-slot acceptance probability ``acceptance`` in [0, 1] at every slot."""
        self._init(oracle, (_check_probability("acceptance", acceptance),), vocab_size, seed)
        self._constant = True  # from_profile clears this

    @classmethod
    def from_profile(
        cls, oracle: Oracle, profile: Sequence[float], vocab_size: int, seed: int = 0
    ) -> SyntheticDrafter:
        """``profile[i]``: probability that slot ``i+1`` is correct given slots 1..i were.

        Block sizes up to ``len(profile) + 1`` are allowed.
        """
        if isinstance(profile, (str, bytes)) or not isinstance(profile, Sequence) or not profile:
            raise DraftArgumentError(
                f"'profile' must be a non-empty sequence of probabilities (got {profile!r})"
            )
        probs = tuple(_check_probability(f"profile[{i}]", p) for i, p in enumerate(profile))
        drafter = cls(oracle, probs[0], vocab_size, seed)
        drafter._probs, drafter._constant = probs, False
        return drafter

    def _init(self, oracle: Oracle, probs: tuple[float, ...], vocab_size: int, seed: int) -> None:
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 2:
            raise DraftArgumentError(f"'vocab_size' must be an int >= 2 (got {vocab_size!r})")
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise DraftArgumentError(f"'seed' must be an int >= 0 (got {seed!r})")
        if callable(oracle):
            self._oracle_fn: Callable[[list[int]], int] | None = oracle
            self._oracle_seq: tuple[int, ...] = ()
        elif isinstance(oracle, Sequence) and not isinstance(oracle, (str, bytes)):
            self._oracle_fn = None
            self._oracle_seq = tuple(
                check_token(f"oracle[{i}]", t, vocab_size) for i, t in enumerate(oracle)
            )
        else:
            raise DraftArgumentError(
                f"'oracle' must be a sequence of token ids or a callable "
                f"(got {type(oracle).__name__})"
            )
        self.vocab_size = vocab_size
        self.seed = seed
        self._probs = probs
        self._attempts: list[int] = []
        self._accepted: list[int] = []
        self._beyond = 0

    def probability(self, slot: int) -> float:
        """Configured acceptance probability of draft slot ``slot`` (1-based)."""
        return self._probs[0] if self._constant else self._probs[slot - 1]

    def _correct(self, seq: list[int], q: int) -> int | None:
        """The oracle's token at position ``q`` (``None``: past a sequence oracle); a
        callable oracle is handed ``seq``, the ``q`` tokens before it."""
        if self._oracle_fn is None:
            return self._oracle_seq[q] if q < len(self._oracle_seq) else None
        token = self._oracle_fn(list(seq))
        return check_token("oracle(...) result", token, self.vocab_size)

    def propose(
        self, context: list[int], last: int, block_size: int, features: Tensor | None = None
    ) -> list[int]:
        """``block_size - 1`` tokens; ``features`` is ignored (no model is involved)."""
        check_block_size(block_size)
        check_token("last", last, self.vocab_size)
        # a sequence oracle reads only len(context), so its step costs the same at any
        # context length (no copy of the context); a callable one is handed the tokens
        seq: list[int] = []
        if self._oracle_fn is None:
            if not isinstance(context, (list, tuple)):
                check_context(context)  # raises, naming the type
        else:
            seq = [*check_context(context, self.vocab_size), last]
        length = len(context) + 1
        if not self._constant and block_size - 1 > len(self._probs):
            raise DraftArgumentError(
                f"'block_size' {block_size} needs {block_size - 1} profile entries, "
                f"the profile has {len(self._probs)}"
            )
        position = len(context)
        if self._oracle_fn is None and position < len(self._oracle_seq):
            expected = self._oracle_seq[position]
            if expected != last:
                raise OracleMismatchError(
                    f"'last' at position {position} is {last}, the oracle has {expected}: "
                    f"the sequence being drafted is not the oracle's greedy continuation"
                )
        rng = random.Random(f"dflash-synthetic:{self.seed}:{position}")
        self._grow(block_size - 1)
        proposal: list[int] = []
        wrong = False
        for slot in range(1, block_size):
            correct = None if wrong else self._correct(seq, length)
            if correct is None:
                if not wrong:
                    self._beyond += 1
                token = rng.randrange(self.vocab_size)  # arbitrary: verification stops earlier
            else:
                self._attempts[slot - 1] += 1
                if rng.random() < self.probability(slot):
                    self._accepted[slot - 1] += 1
                    token = correct
                else:  # any token but the oracle's
                    token = (correct + 1 + rng.randrange(self.vocab_size - 1)) % self.vocab_size
                    wrong = True
            proposal.append(token)
            if self._oracle_fn is not None:
                seq.append(token)
            length += 1
        return proposal

    def _grow(self, slots: int) -> None:
        while len(self._attempts) < slots:
            self._attempts.append(0)
            self._accepted.append(0)

    def profile(self) -> AcceptanceProfile:
        """The achieved acceptance profile of every proposal made so far."""
        return AcceptanceProfile(
            probabilities=self._probs,
            attempts=tuple(self._attempts),
            accepted=tuple(self._accepted),
            beyond_oracle=self._beyond,
        )

    def reset_profile(self) -> None:
        self._attempts, self._accepted, self._beyond = [], [], 0


def _check_probability(name: str, p: object) -> float:
    if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 <= float(p) <= 1.0:
        raise DraftArgumentError(f"{name!r} must be a probability in [0, 1] (got {p!r})")
    return float(p)
