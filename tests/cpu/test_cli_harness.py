"""The commands' timing harness: alternating repeats on one kept engine, medians, parity."""

from __future__ import annotations

import statistics
from typing import Any

import pytest

from dflash.commands.harness import Harness
from dflash.execution import (
    RollbackMode,
    RollbackPolicy,
    SpecDecoder,
    generate,
    plan_shards,
    reference_greedy,
)
from dflash.execution.capture_gate import CaptureGate
from dflash.execution.errors import ContextLengthError
from dflash.execution.rollback import RollbackPath
from dflash.execution.shards import ShardedTarget
from dflash.model import TargetModel
from dflash.model.drafters import PromptLookupDrafter

PROMPT = [5, 17, 200, 3, 5, 17, 200, 3, 9]


@pytest.fixture(scope="module")
def tiny() -> TargetModel:
    return TargetModel.tiny_default(seed=2)


def _kept(tiny: TargetModel, **kw: Any) -> Harness:
    return Harness.kept(tiny, PromptLookupDrafter(), PROMPT, plan_shards(6, "cpu,cpu", "2,4"),
                        max_new_tokens=12, block_size=4, greedy_tokens=12, **kw)


@pytest.mark.parametrize("mode", ["checkpoint", "remap", "recompute"])
def test_repeats_share_one_engine_whose_gate_runs_once(
    tiny: TargetModel, mode: RollbackMode, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The repeats time the speculative decode on one kept engine, as a long-lived one
    serves requests: the capture gate's self-test runs in the first run only, the other
    runs roll back fast from their first step, and the result reports the first run."""
    policy = RollbackPolicy(mode=mode)
    single = generate(tiny, PromptLookupDrafter(), PROMPT, plan=plan_shards(6, "cpu,cpu", "2,4"),
                      max_new_tokens=12, block_size=4, policy=policy)
    harness = _kept(tiny)
    engines: list[SpecDecoder] = []
    tests: list[CaptureGate] = []
    paths: list[str] = []
    targets: list[ShardedTarget] = []
    real_init, real_test, real_commit, real_target = (
        SpecDecoder.__init__, CaptureGate.self_test, SpecDecoder._commit, ShardedTarget.__init__
    )

    def counting_init(self: SpecDecoder, *args: object, **kwargs: object) -> None:
        engines.append(self)
        real_init(self, *args, **kwargs)  # type: ignore[arg-type]

    def counting_test(self: CaptureGate, *args: object, **kwargs: object) -> bool:
        tests.append(self)
        return real_test(self, *args, **kwargs)  # type: ignore[arg-type]

    def noting_commit(
        self: SpecDecoder, path: RollbackPath, failure: str | None
    ) -> list[int]:
        paths.append(path)
        return real_commit(self, path, failure)

    def counting_target(self: ShardedTarget, *args: object, **kwargs: object) -> None:
        targets.append(self)
        real_target(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(SpecDecoder, "__init__", counting_init)
    monkeypatch.setattr(CaptureGate, "self_test", counting_test)
    monkeypatch.setattr(SpecDecoder, "_commit", noting_commit)
    monkeypatch.setattr(ShardedTarget, "__init__", counting_target)
    result = harness.against_greedy(policy, repeats=3, engine=harness.engine(policy))
    assert len(engines) == 1 and len(tests) == 1  # one engine, one self-test
    assert targets == []  # every run on the two kept targets
    steps = single.steps
    assert paths == ["replay", *["fast"] * (3 * steps - 1)]  # only the gate's step replays
    assert result.parity is True and result.tokens == single.tokens
    t, n = result.timings, len(result.tokens)
    assert len(t.decode_runs_s) == len(t.greedy_decode_runs_s) == 3
    assert t.decode_s == statistics.median(t.decode_runs_s)
    assert t.greedy_decode_s == statistics.median(t.greedy_decode_runs_s)
    assert t.tokens_per_s == (n - 1) / t.decode_s
    assert t.greedy_tokens_per_s == (n - 1) / t.greedy_decode_s
    assert result.speedup_vs_greedy == t.tokens_per_s / t.greedy_tokens_per_s
    # the reported statistics are the first run's, as one run reports them
    assert result.steps == steps and result.rollback == single.rollback
    assert result.capture == single.capture and result.capture.verdict == "validated"
    assert result.target_forwards == single.target_forwards
    assert result.avg_commit == single.avg_commit


def test_a_repeat_whose_greedy_tokens_differ_fails_parity(
    tiny: TargetModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    import dflash.execution.run as run_module

    real = reference_greedy
    calls: list[int] = []

    def drifting(*args: Any, **kwargs: Any) -> list[int]:
        tokens = real(*args, **kwargs)
        calls.append(1)
        return tokens if len(calls) < 2 else [*tokens[:-1], tokens[-1] + 1]

    monkeypatch.setattr(run_module, "reference_greedy", drifting)
    harness, policy = _kept(tiny), RollbackPolicy(mode="checkpoint")
    assert harness.against_greedy(policy, engine=harness.engine(policy)).parity is True
    calls.clear()
    result = harness.against_greedy(policy, repeats=2, engine=harness.engine(policy))
    assert len(calls) == 2 and result.parity is False


def test_an_oracle_is_the_parity_reference(tiny: TargetModel) -> None:
    harness, policy = _kept(tiny), RollbackPolicy(mode="replay")
    right = harness.against_greedy(policy).tokens
    wrong = [*right[:-1], right[-1] + 1]
    result = harness.against_greedy(policy, oracle_tokens=wrong)
    assert result.parity is False and result.timings.greedy_decode_s is not None


def test_bad_repeats_are_refused(tiny: TargetModel) -> None:
    harness, policy = _kept(tiny), RollbackPolicy(mode="replay")
    for bad in (0, True, 2.0):
        with pytest.raises(ValueError, match="'repeats' must be an int >= 1"):
            harness.against_greedy(policy, repeats=bad)  # type: ignore[arg-type]  # on purpose
    with pytest.raises(ValueError, match="'repeats'=2 share one engine"):
        harness.against_greedy(policy, repeats=2)
    fresh = Harness(tiny, PromptLookupDrafter(), PROMPT, plan_shards(6), 12, 4)
    with pytest.raises(ValueError, match="a kept engine needs a kept target"):
        fresh.engine(policy)


def test_the_kept_target_refuses_a_budget_past_the_positions(tiny: TargetModel) -> None:
    built: list[object] = []
    with pytest.raises(ContextLengthError, match="max_new_tokens=5000"):
        built.append(Harness.kept(tiny, PromptLookupDrafter(), PROMPT, plan_shards(6),
                                  max_new_tokens=5000, block_size=4, greedy_tokens=5000))
    assert built == []
