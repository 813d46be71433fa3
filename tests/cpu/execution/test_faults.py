"""Fail-closed rollback: a fault at every phase never emits a wrong token, decoding goes on.

Two CPU shards, so ``mid_restore`` fires on shard 2 of 2 after shard 1 has restored.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import pytest
import torch

from dflash.execution import (
    FaultInjector,
    FaultPhase,
    PoisonedError,
    RollbackMode,
    RollbackPolicy,
    RollbackStatus,
    ShardedTarget,
    ShardPositionError,
    SpecDecoder,
    plan_shards,
)
from dflash.execution.rollback import Phase
from dflash.model import TargetModel
from dflash.model.drafters import SyntheticDrafter

N = 14
PROMPT = "digits"


def _engine(
    tiny: TargetModel,
    oracle: list[int],
    prompt: list[int],
    mode: RollbackMode,
    faults: FaultInjector | None = None,
) -> SpecDecoder:
    target = ShardedTarget(tiny, plan_shards(6, "cpu,cpu", "3,3"), max_len=64, max_draft=4)
    drafter = SyntheticDrafter(prompt + oracle, 0.6, tiny.config.vocab_size, seed=5)
    return SpecDecoder(
        target, drafter, block_size=4, policy=RollbackPolicy(mode=mode), faults=faults
    )


def _decode(engine: SpecDecoder, prompt: list[int], n: int) -> list[int]:
    out = [engine.prefill(prompt)]
    while len(out) < n:
        out.extend(engine.step())
    return out[:n]


@pytest.mark.parametrize("mode", ["checkpoint", "remap", "recompute"])
@pytest.mark.parametrize("phase", [p for p in FaultPhase if p is not FaultPhase.DURING_RECOVERY])
def test_fault_at_every_phase_emits_only_greedy_tokens(
    tiny: TargetModel,
    greedy: Callable[[str, int], list[int]],
    prompts: dict[str, list[int]],
    mode: RollbackMode,
    phase: FaultPhase,
) -> None:
    oracle = greedy(PROMPT, N + 4)
    # step 0 validates the gate (replay); the fault hits the fast rollback of steps 1 and 3
    faults = FaultInjector(phase=phase, steps=frozenset({1, 3}), shard=1)
    engine = _engine(tiny, oracle, prompts[PROMPT], mode, faults)
    tokens = _decode(engine, prompts[PROMPT], N)
    assert tokens == oracle[:N]
    assert [s for s, _ in faults.fired] == [1, 3]
    paths = [r.path for r in engine.records]
    assert paths[0] == "replay" and paths[1] == paths[3] == "replay_after_failure"
    assert all(p == "fast" for i, p in enumerate(paths) if i not in (0, 1, 3))
    assert engine.counts["replay_after_failure"] == 2
    # poisoned exactly when the failure came after state began to change
    assert engine.counts["poison_events"] == (0 if phase is FaultPhase.BEFORE_RESTORE else 2)
    poisoned = [h for h in engine.life.history if h[2] is Phase.POISONED]
    assert len(poisoned) == engine.counts["poison_events"]
    assert engine.status is RollbackStatus.EFFECTIVE  # recovered; fast rollback continues
    assert all(r.failure and "injected fault" in r.failure for r in engine.records[1:4:2])


def test_failed_recovery_leaves_poisoned_and_verify_refuses(
    tiny: TargetModel, greedy: Callable[[str, int], list[int]], prompts: dict[str, list[int]]
) -> None:
    oracle = greedy(PROMPT, N + 4)
    prompt = prompts[PROMPT]

    class Twice(FaultInjector):
        """mid-restore on step 1, then the recovery itself fails once."""

        def fire(self, phase: FaultPhase, step: int, shard: int | None = None) -> None:
            wanted = {(FaultPhase.MID_RESTORE, 1), (FaultPhase.DURING_RECOVERY, 1)}
            if (phase, step) in wanted and (step, phase) not in self.fired:
                self.phase = phase
                super().fire(phase, step, shard)

    engine = _engine(tiny, oracle, prompt, "checkpoint", Twice())
    out = [engine.prefill(prompt)]
    out += engine.step()  # step 0: gate + replay
    with pytest.raises(PoisonedError, match="stays poisoned"):
        engine.step()
    assert engine.status is RollbackStatus.POISONED
    forwards = engine.target_forwards
    with pytest.raises(PoisonedError, match="verify refused"):
        engine.step()
    assert engine.target_forwards == forwards  # no forward ran while poisoned
    out += engine.resume()  # pre-verify state restored, accepted tokens replayed
    # the cast: mypy would keep the status narrowed by the assert above across resume()
    assert cast(RollbackStatus, engine.status) is RollbackStatus.EFFECTIVE
    while len(out) < N:
        out += engine.step()
    assert out[:N] == oracle[:N]
    assert engine.records[1].path == "replay_after_failure"


def test_shards_must_agree_on_position_before_restore(
    tiny: TargetModel, greedy: Callable[[str, int], list[int]], prompts: dict[str, list[int]]
) -> None:
    oracle = greedy(PROMPT, N + 4)
    engine = _engine(tiny, oracle, prompts[PROMPT], "checkpoint")
    engine.prefill(prompts[PROMPT])
    engine.step()
    # shard 2 drifts by one position (a bug: its length written behind the pool's back)
    engine.target.shards[1].caches.pool._length += 1
    with pytest.raises(ShardPositionError, match="shard 1 recurrent length"):
        engine.step()


def test_broken_restore_kernel_still_decodes_through_the_models_replay(
    tiny: TargetModel, greedy: Callable[[str, int], list[int]], prompts: dict[str, list[int]]
) -> None:
    oracle = greedy(PROMPT, N + 4)
    prompt = prompts[PROMPT]
    engine = _engine(tiny, oracle, prompt, "checkpoint")
    out = [engine.prefill(prompt)]
    out += engine.step()  # the gate validates on this step
    assert engine.status is RollbackStatus.EFFECTIVE

    def broken(mode: str, commit_n: torch.Tensor) -> None:
        raise RuntimeError(f"{mode} restore kernel failed for commit_n={int(commit_n)}")

    for shard in engine.target.shards:
        shard.caches.pool.rollback_on_device = broken  # type: ignore[method-assign]
    while len(out) < N:
        out += engine.step()
    assert out[:N] == oracle[:N]
    later = engine.records[1:]
    assert later and all(r.path == "replay_after_failure" for r in later)
    assert all("restore kernel failed" in (r.failure or "") for r in later)
    assert engine.counts["poison_events"] == len(later)
