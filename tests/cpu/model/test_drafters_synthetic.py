"""Synthetic drafter: achieved acceptance matches the chosen profile; wrong means wrong."""

from __future__ import annotations

import functools
import json
import math
import random
from collections.abc import Callable

import pytest

from dflash.model.drafters import (
    AcceptanceProfile,
    DraftArgumentError,
    Drafter,
    OracleMismatchError,
    SyntheticDrafter,
)

V = 50
DELTA = 1e-6  # per-check failure probability of a correct implementation (Hoeffding)


def oracle_sequence(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(V) for _ in range(n)]


def hoeffding_radius(n: int, delta: float = DELTA) -> float:
    """P(|mean of n Bernoulli(p) - p| >= r) <= delta for r = sqrt(ln(2/delta) / (2n))."""
    return math.sqrt(math.log(2 / delta) / (2 * n))


def leading_matches(proposal: list[int], oracle: list[int], position: int) -> int:
    """How many draft tokens a target whose greedy output is ``oracle`` would accept."""
    n = 0
    for k, token in enumerate(proposal):
        if token != oracle[position + 1 + k]:
            break
        n += 1
    return n


def run_blocks(
    make: Callable[[int], SyntheticDrafter],
    oracle: list[int],
    block_size: int,
    seeds: range,
    positions: range,
) -> tuple[list[int], list[int]]:
    """Per-slot (attempts, accepted) measured against the oracle itself, not the drafter's
    own report: slot i is attempted when slots 1..i-1 matched, accepted when it matched."""
    attempts = [0] * (block_size - 1)
    accepted = [0] * (block_size - 1)
    for seed in seeds:
        drafter = make(seed)
        for pos in positions:
            proposal = drafter.propose(oracle[:pos], oracle[pos], block_size, None)
            n = leading_matches(proposal, oracle, pos)
            for slot in range(min(n + 1, block_size - 1)):
                attempts[slot] += 1
            for slot in range(n):
                accepted[slot] += 1
    return attempts, accepted


@pytest.mark.parametrize("block_size", [2, 4, 16])
def test_exactly_block_size_minus_one_tokens(block_size: int) -> None:
    oracle = oracle_sequence(40)
    for p in (0.0, 0.5, 1.0):
        drafter = SyntheticDrafter(oracle, p, V, seed=1)
        for pos in (0, 5, 30, 39):  # 39: the whole block is past the oracle's end
            out = drafter.propose(oracle[:pos], oracle[pos], block_size, None)
            assert len(out) == block_size - 1
            assert all(isinstance(t, int) and 0 <= t < V for t in out)


def test_is_clearly_labelled_synthetic() -> None:
    drafter = SyntheticDrafter(oracle_sequence(10), 0.5, V)
    assert isinstance(drafter, Drafter)
    assert drafter.label == "synthetic" and drafter.tap_layers == ()
    assert "SYNTHETIC" in (SyntheticDrafter.__doc__ or "")
    drafter.propose(oracle_sequence(10)[:3], oracle_sequence(10)[3], 4, None)
    report = json.loads(drafter.profile().model_dump_json())
    assert report["label"] == "synthetic" and "synthetic" in report["note"]


def test_p_one_proposes_the_oracle_and_p_zero_never_does() -> None:
    oracle = oracle_sequence(300)
    always = SyntheticDrafter(oracle, 1.0, V, seed=4)
    never = SyntheticDrafter(oracle, 0.0, V, seed=4)
    for pos in range(0, 280, 7):
        assert always.propose(oracle[:pos], oracle[pos], 8, None) == oracle[pos + 1 : pos + 8]
        first = never.propose(oracle[:pos], oracle[pos], 8, None)[0]
        assert first != oracle[pos + 1], f"p=0 proposed the oracle token at position {pos}"
    assert always.profile().per_token_rate == 1.0
    assert never.profile().per_token_rate == 0.0


def test_achieved_acceptance_matches_p() -> None:
    oracle = oracle_sequence(120, seed=2)
    for p in (0.3, 0.8):
        attempts, accepted = run_blocks(
            functools.partial(SyntheticDrafter, oracle, p, V),  # called with the seed
            oracle,
            2,
            range(100),
            range(100),
        )
        n = attempts[0]
        assert n == 10_000
        assert abs(accepted[0] / n - p) < hoeffding_radius(n), (p, accepted[0] / n)


def test_profile_is_reproduced_per_slot_and_reported() -> None:
    oracle = oracle_sequence(120, seed=3)
    profile = (0.9, 0.5, 0.2, 0.7)
    drafters: list[SyntheticDrafter] = []

    def make(seed: int) -> SyntheticDrafter:
        drafters.append(SyntheticDrafter.from_profile(oracle, profile, V, seed=seed))
        return drafters[-1]

    attempts, accepted = run_blocks(make, oracle, 5, range(60), range(100))
    assert attempts[0] == 6000
    for slot, p in enumerate(profile):
        m = attempts[slot]  # given m, the m draws at this slot are Bernoulli(p), independent
        assert m > 0
        assert abs(accepted[slot] / m - p) < hoeffding_radius(m), (slot, accepted[slot] / m, p)
    # each drafter's own report agrees with what the oracle comparison measured
    reported = [d.profile() for d in drafters]
    assert [sum(r.attempts[s] for r in reported) for s in range(4)] == attempts
    assert [sum(r.accepted[s] for r in reported) for s in range(4)] == accepted
    assert reported[0].probabilities == profile


def test_wrong_tokens_differ_from_the_oracle_and_counts_are_consistent() -> None:
    oracle = oracle_sequence(400, seed=5)
    drafter = SyntheticDrafter(oracle, 0.5, V, seed=9)
    measured = 0
    for pos in range(380):
        proposal = drafter.propose(oracle[:pos], oracle[pos], 6, None)
        measured += leading_matches(proposal, oracle, pos)
    profile = drafter.profile()
    # if a "wrong" token ever equalled the oracle's, the target would accept more than reported
    assert sum(profile.accepted) == measured
    assert profile.attempts[0] == 380
    assert all(profile.attempts[s + 1] == profile.accepted[s] for s in range(4))
    assert profile.mean_accepted == measured / 380


def test_deterministic_by_seed_and_independent_of_call_history() -> None:
    oracle = oracle_sequence(200, seed=6)

    def proposals(seed: int, positions: list[int]) -> list[list[int]]:
        d = SyntheticDrafter(oracle, 0.6, V, seed=seed)
        return [d.propose(oracle[:p], oracle[p], 6, None) for p in positions]

    positions = list(range(0, 150, 3))
    assert proposals(1, positions) == proposals(1, positions)
    assert proposals(1, positions) != proposals(2, positions)
    assert proposals(1, positions[::-1]) == proposals(1, positions)[::-1]


def test_callable_oracle() -> None:
    def next_token(prefix: list[int]) -> int:
        return (prefix[-1] * 7 + 3) % V

    drafter = SyntheticDrafter(next_token, 1.0, V, seed=0)
    out = drafter.propose([1, 2], 5, 5, None)
    expected = [5]
    for _ in range(4):
        expected.append(next_token(expected))
    assert out == expected[1:]
    bad = SyntheticDrafter(lambda prefix: V + 3, 1.0, V)
    with pytest.raises(
        DraftArgumentError,
        match=rf"'oracle\(...\) result' must be < vocab_size={V} \(got {V + 3}\)",
    ):
        bad.propose([1], 2, 3, None)


def test_beyond_the_oracle_is_filled_and_not_counted() -> None:
    oracle = oracle_sequence(10)
    drafter = SyntheticDrafter(oracle, 1.0, V)
    out = drafter.propose(oracle[:7], oracle[7], 6, None)  # slots 1,2 known; 3..5 past the end
    assert out[:2] == oracle[8:10] and len(out) == 5
    profile = drafter.profile()
    assert profile.attempts[:2] == (1, 1) and profile.attempts[2:] == (0, 0, 0)
    assert profile.beyond_oracle == 3
    drafter.reset_profile()
    assert drafter.profile() == AcceptanceProfile(
        probabilities=(1.0,), attempts=(), accepted=(), beyond_oracle=0
    )


def test_oracle_mismatch_is_reported() -> None:
    oracle = oracle_sequence(20)
    drafter = SyntheticDrafter(oracle, 0.5, V)
    wrong = (oracle[4] + 1) % V
    with pytest.raises(
        OracleMismatchError, match=rf"'last' at position 4 is {wrong}, the oracle has {oracle[4]}"
    ):
        drafter.propose(oracle[:4], wrong, 4, None)


@pytest.mark.parametrize("p", [-0.1, 1.5, float("nan"), True, "0.5"])
def test_bad_probability(p: object) -> None:
    with pytest.raises(
        DraftArgumentError, match=rf"'acceptance' must be a probability in \[0, 1\] \(got {p!r}\)"
    ):
        SyntheticDrafter([1, 2], p, V)  # type: ignore[arg-type]  # deliberately bad


def test_bad_profile_and_other_arguments() -> None:
    with pytest.raises(
        DraftArgumentError, match=r"'profile\[1\]' must be a probability .*\(got 2\)"
    ):
        SyntheticDrafter.from_profile([1], [0.5, 2], V)
    with pytest.raises(DraftArgumentError, match=r"'profile' must be a non-empty sequence"):
        SyntheticDrafter.from_profile([1], [], V)
    with pytest.raises(DraftArgumentError, match=r"'vocab_size' must be an int >= 2 \(got 1\)"):
        SyntheticDrafter([0], 0.5, 1)
    with pytest.raises(DraftArgumentError, match=r"'seed' must be an int >= 0 \(got -1\)"):
        SyntheticDrafter([0], 0.5, V, seed=-1)
    with pytest.raises(
        DraftArgumentError, match=rf"'oracle\[2\]' must be < vocab_size={V} \(got {V}\)"
    ):
        SyntheticDrafter([0, 1, V], 0.5, V)
    with pytest.raises(DraftArgumentError, match=r"'oracle' must be a sequence .*\(got int\)"):
        SyntheticDrafter(7, 0.5, V)  # type: ignore[arg-type]  # deliberately bad
    short = SyntheticDrafter.from_profile(oracle_sequence(20), [0.5, 0.5], V)
    with pytest.raises(
        DraftArgumentError, match=r"'block_size' 4 needs 3 profile entries, the profile has 2"
    ):
        short.propose([1], oracle_sequence(20)[1], 4, None)
    with pytest.raises(DraftArgumentError, match=r"'block_size' must be an int >= 2 \(got 1\)"):
        short.propose([1], oracle_sequence(20)[1], 1, None)
