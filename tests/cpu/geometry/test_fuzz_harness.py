"""The fuzz oracle and recorder: seeds pass, planted bugs are caught, crashes reproduce."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from dflash.geometry import RejectReason, validate_tree
from fuzz import oracle
from fuzz.make_seeds import CASES
from fuzz.stats import Recorder

SEEDS = sorted((Path(oracle.__file__).parent / "seeds").glob("*.bin"))


def encode(parents: list[int], nbyte: int, container: int) -> bytes:
    return bytes([container, nbyte]) + struct.pack(f"<{len(parents)}i", *parents)


def test_committed_seeds_pass_and_reach_every_reason() -> None:
    assert len(SEEDS) == len(CASES) * len(oracle.CONTAINERS)
    reached: set[str] = set()
    for path in SEEDS:
        reached.update(oracle.check_one(path.read_bytes()))
    assert {r.value for r in RejectReason} <= reached
    assert {"chain", "tree"} <= reached


def test_oracle_distinguishes_equal_values_of_different_types() -> None:
    # [-1.0, 0.0] (numpy float) must not reuse the verdict of [-1, 0]: 1 == 1.0 in Python
    assert oracle.check_one(encode([-1, 0], 0xFF, 7)) == ("not_integer", "not_integer")
    assert oracle.check_one(encode([-1, 0], 0xFF, 0)) == ("chain", "tree")
    assert oracle.check_one(encode([-1, 0], 0xFF, 7)) == ("not_integer", "not_integer")


def test_oracle_catches_a_planted_validator_bug(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(oracle, "validate_chain", validate_tree)
    with pytest.raises(oracle.OracleMismatch, match="validator"):
        oracle.check_one(encode([-1, 0, 0, 2], 4, 0))


def test_partial_trailing_word_is_a_null_decode_then_ignored() -> None:
    assert oracle.check_one(encode([-1, 0], 0xFF, 0) + b"\x01") == ("chain", "tree")


def test_recorder_writes_reproducers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    recorder = Recorder(tmp_path / "crashes")
    recorder.run(encode([-1, 0], 0xFF, 0))
    monkeypatch.setattr(oracle, "validate_chain", validate_tree)
    monkeypatch.setattr("fuzz.stats.check_one", oracle.check_one)
    bad = encode([-1, 0, 0], 0xFF, 1)
    recorder.run(bad)
    recorder.run(bad)  # the same crash is stored once
    snap = recorder.snapshot()
    assert snap["executions"] == 3 and len(snap["crashes"]) == 1
    reproducer = Path(snap["crashes"][0]["reproducer"])
    assert reproducer.read_bytes() == bad
    assert "OracleMismatch" in reproducer.with_suffix(".txt").read_text()
