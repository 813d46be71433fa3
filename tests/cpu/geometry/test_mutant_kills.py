"""Behaviour pinned for mutants of ``dflash/geometry`` that the other geometry tests let
through (``python -m mutation``); each test names the behaviour, not the mutant."""

from __future__ import annotations

import json

import pytest

from dflash.geometry import verdict_from_dict, verdict_from_json


@pytest.mark.parametrize(("text", "message"), [
    ("[1, 2]", "a verdict must be a JSON object (got list)"),
    ('"chain"', "a verdict must be a JSON object (got str)"),
    ('{"kind": "chain", "parents": [-1]}', "'accepted' must be true or false (got None)"),
    ('{"accepted": "yes", "kind": "chain", "parents": [-1]}',
     "'accepted' must be true or false (got 'yes')"),
    ('{"accepted": 1, "kind": "chain", "parents": [-1]}',
     "'accepted' must be true or false (got 1)"),
])
def test_malformed_verdict_json_is_refused_by_name(text: str, message: str) -> None:
    with pytest.raises(ValueError) as err:
        verdict_from_json(text)
    assert str(err.value) == message
    with pytest.raises(ValueError):
        verdict_from_dict(json.loads(text))


def test_too_large_message_says_whether_n_actual_was_given() -> None:
    from dflash.geometry import MAX_SLOTS, Rejection, validate_chain

    long = [-1, *range(MAX_SLOTS)]
    given = validate_chain(long, MAX_SLOTS + 1)
    defaulted = validate_chain(long)
    assert isinstance(given, Rejection) and isinstance(defaulted, Rejection)
    assert given.message == "'n_actual' must be at most MAX_SLOTS=1024 (got 1025)"
    assert defaulted.message == ("'n_actual' (default: len(parents)) must be at most "
                                 "MAX_SLOTS=1024 (got 1025)")
