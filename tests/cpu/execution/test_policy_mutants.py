"""The rollback policy's behaviour, pinned tightly enough that a mutant of
``dflash/execution/policy.py`` fails here (``python -m mutation --only
dflash/execution/policy.py``)."""

from __future__ import annotations

import pytest

from dflash.execution import ROLLBACK_MODES, RollbackConfigError, RollbackPolicy, RollbackStatus
from dflash.execution.policy import DEFAULT_MODE, ENV_VAR, parse_mode


def test_modes_and_environment_variable() -> None:
    assert ROLLBACK_MODES == ("replay", "checkpoint", "remap", "recompute")
    assert ENV_VAR == "DFLASH_ROLLBACK"
    assert [s.value for s in RollbackStatus] == ["off", "requested", "effective", "poisoned"]
    assert str(RollbackStatus.EFFECTIVE.value) == "effective"


@pytest.mark.parametrize("mode", ["replay", "checkpoint", "remap", "recompute"])
def test_parse_mode_normalises_case_and_spaces(mode: str) -> None:
    assert parse_mode(mode, source="x") == mode
    assert parse_mode(f"  {mode.upper()}\t", source="x") == mode


@pytest.mark.parametrize("bad", ["", "on", "fast", "remap!", "re map"])
def test_parse_mode_names_the_source_and_value(bad: str) -> None:
    with pytest.raises(RollbackConfigError) as err:
        parse_mode(bad, source="the knob")
    modes = "replay, checkpoint, remap, recompute"
    assert str(err.value) == f"the knob must be one of {modes} (got {bad!r})"


def test_parse_mode_refuses_non_strings_without_crashing() -> None:
    for bad in (None, 3, ["remap"]):
        with pytest.raises(RollbackConfigError, match=r"\(got "):
            parse_mode(bad, source="s")  # type: ignore[arg-type]  # hostile input on purpose


def test_policy_defaults_and_fast_flag() -> None:
    policy = RollbackPolicy()  # fast rollback requested by default; the gate decides
    assert policy.mode == "checkpoint" and policy.fast
    assert not RollbackPolicy(mode="replay").fast
    assert RollbackPolicy(mode="checkpoint").fast and RollbackPolicy(mode="remap").fast


def test_policy_is_frozen_and_strict() -> None:
    policy = RollbackPolicy(mode="remap")
    with pytest.raises(Exception, match="frozen"):
        policy.mode = "replay"  # a mutation attempt on purpose
    with pytest.raises(Exception, match="extra"):
        RollbackPolicy(mode="remap", colour="red")  # type: ignore[call-arg]  # on purpose
    with pytest.raises(Exception, match="mode"):
        RollbackPolicy(mode="on")  # type: ignore[arg-type]  # on purpose


def test_resolve_precedence_and_sources() -> None:
    env = {ENV_VAR: "remap"}
    assert RollbackPolicy.resolve("replay", environ=env).mode == "replay"  # CLI first
    assert RollbackPolicy.resolve(None, environ=env).mode == "remap"  # then environment
    assert RollbackPolicy.resolve(None, environ={}).mode == "checkpoint"  # then the default
    assert DEFAULT_MODE == "checkpoint"
    assert RollbackPolicy.resolve(None, environ={ENV_VAR: ""}).mode == "checkpoint"  # unset
    assert RollbackPolicy.resolve(None, environ={"OTHER": "remap"}).mode == "checkpoint"
    assert RollbackPolicy.resolve(None, environ={}) == RollbackPolicy(mode=DEFAULT_MODE)
    with pytest.raises(RollbackConfigError, match=r"^--rollback must be one of .*'nope'"):
        RollbackPolicy.resolve("nope", environ=env)
    with pytest.raises(RollbackConfigError,
                       match=r"^environment variable DFLASH_ROLLBACK must be one of .*'nope'"):
        RollbackPolicy.resolve(None, environ={ENV_VAR: "nope"})


def test_resolve_reads_the_process_environment_by_default(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_VAR, "remap")
    assert RollbackPolicy.resolve().mode == "remap"
    monkeypatch.delenv(ENV_VAR)
    assert RollbackPolicy.resolve().mode == "checkpoint"
