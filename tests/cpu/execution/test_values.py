"""Small values: policy resolution, status names, SHA-256, the lifecycle table, shard plans."""

from __future__ import annotations

import hashlib
import struct

import pytest

from dflash.execution import (
    IllegalTransitionError,
    LayerSplitError,
    Lifecycle,
    Phase,
    PoisonedError,
    RollbackConfigError,
    RollbackPolicy,
    RollbackStatus,
    plan_shards,
    token_sha256,
)
from dflash.execution.session import SessionError, per_slot_probability


def test_policy_precedence_cli_then_environment_then_default() -> None:
    assert RollbackPolicy.resolve(None, environ={}).mode == "checkpoint"
    assert RollbackPolicy.resolve(None, environ={"DFLASH_ROLLBACK": " Remap "}).mode == "remap"
    env = {"DFLASH_ROLLBACK": "remap"}
    assert RollbackPolicy.resolve("checkpoint", environ=env).mode == "checkpoint"
    with pytest.raises(RollbackConfigError, match=r"--rollback must be one of .* \(got 'on'\)"):
        RollbackPolicy.resolve("on", environ={})
    assert not RollbackPolicy(mode="replay").fast and RollbackPolicy(mode="remap").fast


def test_status_values_never_say_on() -> None:
    assert [s.value for s in RollbackStatus] == ["off", "requested", "effective", "poisoned"]


def test_sha256_is_over_int32_little_endian() -> None:
    ids = [3, 14, 15, 92, 65535, 248319]
    expected = hashlib.sha256(struct.pack("<6i", *ids)).hexdigest()
    assert token_sha256(ids) == expected
    assert token_sha256([]) == hashlib.sha256(b"").hexdigest()


def test_lifecycle_refuses_what_the_table_does_not_allow() -> None:
    life = Lifecycle()
    with pytest.raises(
        IllegalTransitionError, match="event 'verify' is not allowed in phase 'empty'"
    ):
        life.move("verify")
    life.move("prefill")
    life.move("verify")
    with pytest.raises(IllegalTransitionError, match="'commit' is not allowed in phase 'verified'"):
        life.move("commit")
    life.move("fail")
    with pytest.raises(PoisonedError, match="verify refused"):
        life.move("verify")
    life.move("recover")
    life.move("commit")
    assert life.phase is Phase.CLEAN


def test_shard_plans() -> None:
    assert plan_shards(6, "cpu,cpu").split == (3, 3)
    assert plan_shards(7, ["cpu", "cpu"]).split == (4, 3)
    assert plan_shards(6, "cpu,cpu", "2,4").ranges == ((0, 2), (2, 6))
    with pytest.raises(LayerSplitError, match="entries must be integers"):
        plan_shards(6, "cpu,cpu", "3,x")
    with pytest.raises(LayerSplitError, match="'tpu:0' is not a torch device"):
        plan_shards(6, "tpu:0")
    with pytest.raises(LayerSplitError, match="3 devices need at least 3 layers"):
        plan_shards(2, "cpu,cpu,cpu")


def test_per_slot_probability_hits_the_drafted_rate() -> None:
    p = per_slot_probability(0.4, 16)
    assert sum(p**i for i in range(1, 16)) / 15 == pytest.approx(0.4, abs=1e-9)
    assert 0.87 < p < 0.88
    assert per_slot_probability(0.0, 4) == pytest.approx(0.0, abs=1e-12)
    assert per_slot_probability(1.0, 4) == pytest.approx(1.0, abs=1e-12)
    with pytest.raises(SessionError, match=r"'drafted_acceptance' must be in \[0, 1\] \(got 1.5\)"):
        per_slot_probability(1.5, 16)
