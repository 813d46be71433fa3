"""Prompt-lookup drafter: longest/most-recent n-gram match, periodic fill, fallback, errors."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dflash.model.drafters import DraftArgumentError, Drafter, PromptLookupDrafter


@pytest.mark.parametrize("block_size", [2, 4, 16])
@pytest.mark.parametrize("context", [[], [3], [1, 2, 3, 1, 2], list(range(40))])
def test_exactly_block_size_minus_one_tokens(context: list[int], block_size: int) -> None:
    out = PromptLookupDrafter().propose(context, 2, block_size, None)
    assert len(out) == block_size - 1
    assert all(isinstance(t, int) for t in out)


def test_is_a_drafter_without_taps() -> None:
    drafter = PromptLookupDrafter()
    assert isinstance(drafter, Drafter)
    assert drafter.tap_layers == () and drafter.label == "prompt-lookup"


def test_finds_a_repeat_and_copies_what_followed() -> None:
    result = PromptLookupDrafter().lookup([5, 6, 7, 8, 9, 5, 6], 7, 4)
    assert result.tokens == (8, 9, 5)
    assert (result.ngram, result.match_start, result.copied) == (3, 0, 3)


def test_longest_ngram_wins_over_a_more_recent_shorter_one() -> None:
    # "1 2 3" occurred once (then 40); "2 3" occurred more recently (then 50)
    context = [1, 2, 3, 40, 9, 2, 3, 50, 9, 1, 2]
    assert PromptLookupDrafter(max_ngram=3).lookup(context, 3, 2).tokens == (40,)
    assert PromptLookupDrafter(max_ngram=2).lookup(context, 3, 2).tokens == (50,)


def test_most_recent_occurrence_is_used() -> None:
    context = [7, 8, 1, 7, 8, 2, 0, 7]
    result = PromptLookupDrafter(max_ngram=2).lookup(context, 8, 2)
    assert result.tokens == (2,) and result.match_start == 3


def test_continuation_repeats_periodically_past_the_end() -> None:
    result = PromptLookupDrafter().lookup([4, 5, 4, 5], 4, 8)
    # seq 4 5 4 5 4: suffix "4 5 4" matches at 0, followed by 5 4, then the pattern repeats
    assert result.tokens == (5, 4, 5, 4, 5, 4, 5)
    assert result.copied == 2


def test_falls_back_to_repeating_last_when_nothing_matches() -> None:
    result = PromptLookupDrafter().lookup([1, 2, 3, 4], 9, 5)
    assert result.tokens == (9, 9, 9, 9)
    assert (result.ngram, result.match_start, result.copied) == (0, None, 0)


def test_min_ngram_is_respected() -> None:
    # only a 1-gram (token 3) repeats
    assert PromptLookupDrafter(min_ngram=1).lookup([3, 8, 1], 3, 2).tokens == (8,)
    assert PromptLookupDrafter(min_ngram=2).lookup([3, 8, 1], 3, 2).tokens == (3,)


def test_max_search_limits_the_window_and_reports_full_indices() -> None:
    context = [6, 7, 11, 0, 0, 0, 0, 0, 6, 7, 12, 1, 6]
    wide = PromptLookupDrafter(max_ngram=2).lookup(context, 7, 2)
    assert wide.tokens == (12,) and wide.match_start == 8
    narrow = PromptLookupDrafter(max_ngram=2, max_search=6).lookup(context, 7, 2)
    assert narrow.tokens == (12,) and narrow.match_start == 8
    too_narrow = PromptLookupDrafter(max_ngram=2, max_search=4).lookup(context, 7, 2)
    assert too_narrow.ngram == 0


def _reference(seq: list[int], n_max: int, n_min: int) -> tuple[int, int] | None:
    """Brute force: longest n, then largest start j < len-n, with seq[j:j+n] == seq[-n:]."""
    for n in range(min(n_max, len(seq) - 1), n_min - 1, -1):
        starts = [j for j in range(len(seq) - n) if seq[j : j + n] == seq[len(seq) - n :]]
        if starts:
            return n, max(starts)
    return None


@settings(max_examples=300, deadline=None)
@given(
    context=st.lists(st.integers(0, 3), max_size=30),
    last=st.integers(0, 3),
    block_size=st.integers(2, 12),
    n_max=st.integers(1, 4),
    n_min=st.integers(1, 4),
)
def test_matches_brute_force_reference(
    context: list[int], last: int, block_size: int, n_max: int, n_min: int
) -> None:
    n_min = min(n_min, n_max)
    drafter = PromptLookupDrafter(max_ngram=n_max, min_ngram=n_min)
    result = drafter.lookup(context, last, block_size)
    seq = [*context, last]
    assert len(result.tokens) == block_size - 1
    expected = _reference(seq, n_max, n_min)
    if expected is None:
        assert result.ngram == 0 and result.tokens == (last,) * (block_size - 1)
        return
    n, j = expected
    assert (result.ngram, result.match_start) == (n, j)
    ext = list(seq)
    for k in range(block_size - 1):
        ext.append(ext[j + n + k])
    assert result.tokens == tuple(ext[len(seq) :])
    assert result.tokens[: result.copied] == tuple(seq[j + n : j + n + result.copied])


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"max_ngram": 0}, "'max_ngram' must be an int >= 1 (got 0)"),
        ({"min_ngram": -2}, "'min_ngram' must be an int >= 1 (got -2)"),
        ({"max_ngram": 2, "min_ngram": 3}, "'min_ngram' (3) must be <= 'max_ngram' (2)"),
        ({"max_search": 1}, "'max_search' must be None or an int >= 2 (got 1)"),
        ({"max_ngram": True}, "'max_ngram' must be an int >= 1 (got True)"),
    ],
)
def test_bad_construction_arguments(kwargs: dict[str, int], needle: str) -> None:
    with pytest.raises(DraftArgumentError) as err:
        PromptLookupDrafter(**kwargs)
    assert needle in str(err.value)


def test_bad_propose_arguments() -> None:
    drafter = PromptLookupDrafter()
    with pytest.raises(DraftArgumentError, match=r"'block_size' must be an int >= 2 \(got 1\)"):
        drafter.propose([1, 2], 3, 1, None)
    with pytest.raises(DraftArgumentError, match=r"'last' must be a token id.*\(got -4\)"):
        drafter.propose([1, 2], -4, 4, None)
    with pytest.raises(DraftArgumentError, match=r"'context\[1\]' must be a token id.*\(got 'x'\)"):
        drafter.propose([1, "x"], 3, 4, None)  # type: ignore[list-item]  # deliberately bad
    with pytest.raises(DraftArgumentError, match=r"'context' must be a list .*\(got str\)"):
        drafter.propose("123", 3, 4, None)  # type: ignore[arg-type]  # deliberately bad


def _brute_force_match(seq: list[int], max_ngram: int) -> tuple[int, int] | None:
    """The rule, spelled out: the largest n, then the most recent earlier occurrence."""
    for n in range(min(max_ngram, len(seq) - 1), 0, -1):
        suffix = seq[-n:]
        for j in range(len(seq) - n - 1, -1, -1):
            if seq[j : j + n] == suffix:
                return n, j
    return None


def test_lookup_equals_the_brute_force_rule_on_random_contexts() -> None:
    import random

    rng = random.Random(5)
    for trial in range(400):
        vocab = rng.choice([2, 3, 5, 50])
        max_ngram = rng.randrange(1, 5)
        drafter = PromptLookupDrafter(max_ngram=max_ngram)
        context = [rng.randrange(vocab) for _ in range(rng.randrange(0, 40))]
        for _ in range(3):  # a growing context, then one that changed earlier
            last = rng.randrange(vocab)
            got = drafter.lookup(context, last, 6)
            want = _brute_force_match([*context, last], max_ngram)
            if want is None:
                assert got.ngram == 0 and got.tokens == (last,) * 5, trial
            else:
                assert (got.ngram, got.match_start) == want, (trial, context, last)
            context = [*context, last, rng.randrange(vocab)]
        context[0] = vocab  # an edit before the checked prefix: checked again from 0


def test_every_call_names_a_bad_context_entry() -> None:
    drafter = PromptLookupDrafter()
    context = [1, 2, 3, 1, 2]
    drafter.propose(context, 3, 4)
    with pytest.raises(DraftArgumentError, match=r"'context\[6\]'"):
        drafter.propose([*context, 4, -1], 3, 4)  # a new entry
    with pytest.raises(DraftArgumentError, match=r"'context\[1\]'"):
        drafter.propose([1, -2, 3, 1, 2, 4], 3, 4)  # an entry the last call had checked
    with pytest.raises(DraftArgumentError, match=r"'context\[0\]'"):
        drafter.propose([True, 2, 3], 3, 4)
    drafter.propose([1, 2, 3], 3, 4)
    for equal_but_not_int in (True, 1.0):  # == 1, so the prefix compares equal
        with pytest.raises(DraftArgumentError, match=r"'context\[0\]'"):
            drafter.propose([equal_but_not_int, 2, 3, 4], 3, 4)  # type: ignore[list-item]  # on purpose
    assert drafter.propose([*context, 4], 3, 4) == drafter.propose([*context, 4], 3, 4)


def _brute_force_lookup(
    context: list[int], last: int, block: int, max_ngram: int, min_ngram: int,
    max_search: int | None,
) -> tuple[tuple[int, ...], int, int | None, int]:
    """The whole proposal, spelled out on the searched window of ``context + [last]``."""
    seq = [*context, last]
    offset = 0 if max_search is None else max(0, len(seq) - max_search)
    seq = seq[offset:]
    match = _brute_force_match(seq, max_ngram)
    if match is None or match[0] < min_ngram:
        return (last,) * (block - 1), 0, None, 0
    n, j = match
    ext = list(seq)
    for k in range(block - 1):
        ext.append(ext[j + n + k])  # periodic once past seq
    return tuple(ext[len(seq):]), n, j + offset, min(block - 1, len(seq) - (j + n))


def test_the_indexed_lookup_equals_the_rule_in_a_window_as_the_context_grows() -> None:
    """Random contexts that grow by a few tokens a call (as the engine's), sometimes
    handed as a tuple or edited before the indexed prefix: every field of every proposal
    equals the rule's, with and without a search window and a minimum n-gram."""
    import random

    rng = random.Random(11)
    for trial in range(300):
        vocab = rng.choice([2, 3, 7, 40])
        max_ngram = rng.randrange(1, 5)
        min_ngram = rng.randrange(1, max_ngram + 1)
        max_search = rng.choice([None, 2, 5, 12])
        drafter = PromptLookupDrafter(max_ngram, min_ngram, max_search)
        context = [rng.randrange(vocab) for _ in range(rng.randrange(0, 30))]
        for step in range(9):
            last, block = rng.randrange(vocab), rng.randrange(2, 9)
            given = tuple(context) if step == 3 else list(context)
            got = drafter.lookup(given, last, block)  # type: ignore[arg-type]  # a tuple too
            want = _brute_force_lookup(context, last, block, max_ngram, min_ngram, max_search)
            assert (got.tokens, got.ngram, got.match_start, got.copied) == want, (
                trial, step, context, last, block)
            context = [*context, last, *(rng.randrange(vocab) for _ in range(rng.randrange(3)))]
            if step in (2, 4, 6) and context:  # old entries edited: indexed again from 0
                for _ in range(rng.randrange(1, 4)):
                    context[rng.randrange(len(context))] = rng.randrange(vocab)
