"""Resource faults fail closed.

- Capture storage that cannot be allocated (injected through ``allocate_capture``) keeps a
  fast mode ``requested``: every step rolls back through replay, the tokens stay greedy's,
  and ``fast_unavailable_reason`` says why; if not even the replay path's buffers fit, a
  typed ``CaptureStorageError``.
- A budget past the model's positions is refused before any decoding, with the numbers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import cast

import pytest
import torch

import dflash.model.caches as caches_module
from dflash.errors import UsageError
from dflash.execution import (
    RollbackMode,
    RollbackPolicy,
    RollbackStatus,
    ShardedTarget,
    SpecDecoder,
    plan_shards,
)
from dflash.execution.engine import chain_of
from dflash.execution.errors import ContextLengthError, ExecutionError
from dflash.execution.run import generate, positions_needed
from dflash.model import TargetModel
from dflash.model.caches import CacheError, CaptureKind, CaptureStorageError
from dflash.model.drafters import SyntheticDrafter
from dflash.model.drafters.prompt_lookup import PromptLookupDrafter

PROMPT = [3, 14, 15, 92, 65, 35]
N = 14
REAL_ALLOCATE = caches_module.allocate_capture


@contextmanager
def failing_allocation(
    monkeypatch: pytest.MonkeyPatch,
    refuse: Callable[[str, tuple[int, ...]], bool],
    error: Exception,
) -> Iterator[list[tuple[str, tuple[int, ...]]]]:
    """``allocate_capture`` raises ``error`` for the buffers ``refuse(what, shape)`` picks."""
    asked: list[tuple[str, tuple[int, ...]]] = []

    def allocate(what: str, shape: tuple[int, ...], dtype: torch.dtype, device: object):  # type: ignore[no-untyped-def]
        asked.append((what, shape))
        if refuse(what, shape):
            raise error
        return REAL_ALLOCATE(what, shape, dtype, device)  # type: ignore[arg-type]

    with monkeypatch.context() as m:
        m.setattr(caches_module, "allocate_capture", allocate)
        yield asked


def full_checkpoints(what: str, shape: tuple[int, ...]) -> bool:
    """Refuse the per-layer checkpoint slots (more than one layer), allow the rest."""
    return what == "checkpoints" and shape[0] > 1


def full_inputs(what: str, shape: tuple[int, ...]) -> bool:
    """Refuse the per-layer recurrence inputs (more than one layer), allow the rest."""
    return what == "inputs" and shape[0] > 1


#: per fast mode: what its target captures, the buffer refused, how the message names it
STORAGE: dict[str, tuple[CaptureKind, Callable[[str, tuple[int, ...]], bool], str]] = {
    "checkpoint": ("states", full_checkpoints, "checkpoint storage"),
    "remap": ("states", full_checkpoints, "checkpoint storage"),
    "recompute": ("inputs", full_inputs, "recompute input storage"),
}


def _target(tiny: TargetModel, capture: CaptureKind = "states") -> ShardedTarget:
    return ShardedTarget(
        tiny, plan_shards(6, "cpu,cpu", "3,3"), max_len=64, max_draft=4, capture=capture
    )


def _engine(
    tiny: TargetModel, target: ShardedTarget, oracle: list[int], mode: RollbackMode
) -> SpecDecoder:
    drafter = SyntheticDrafter(PROMPT + oracle, 0.6, tiny.config.vocab_size, seed=5)
    return SpecDecoder(target, drafter, block_size=4, policy=RollbackPolicy(mode=mode))


def _decode(engine: SpecDecoder, n: int) -> list[int]:
    out = [engine.prefill(PROMPT)]
    while len(out) < n:
        out.extend(engine.step())
    return out[:n]


OOM_ERRORS = [
    torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
    RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory"),
    MemoryError(),
]


@pytest.mark.parametrize("error", OOM_ERRORS, ids=["torch-oom", "runtime-oom", "memory-error"])
@pytest.mark.parametrize("mode", ["checkpoint", "remap", "recompute"])
def test_capture_storage_that_does_not_fit_leaves_fast_requested_on_replay(
    tiny: TargetModel,
    greedy: Callable[[str, int], list[int]],
    monkeypatch: pytest.MonkeyPatch,
    mode: RollbackMode,
    error: Exception,
) -> None:
    oracle = greedy("digits", N + 4)
    capture, refuse, storage = STORAGE[mode]
    whole = _target(tiny, capture)
    need = [s.caches.checkpoint_bytes for s in whole.shards]  # what full storage takes
    with failing_allocation(monkeypatch, refuse, error):
        target = _target(tiny, capture)
    engine = _engine(tiny, target, oracle, mode)
    assert engine.status is RollbackStatus.REQUESTED
    assert _decode(engine, N) == oracle[:N]
    assert engine.status is RollbackStatus.REQUESTED  # never effective
    assert engine.counts["fast"] == 0 and engine.counts["replay"] == len(engine.records)
    assert engine.gate.report.verdict == "not_run"
    reason = engine.fast_unavailable_reason
    assert reason is not None
    for k, n in enumerate(need):
        assert f"shard {k}: {storage} of {n} bytes could not be allocated on cpu" in reason
    assert type(error).__name__ in reason
    assert target.checkpoint_bytes < whole.checkpoint_bytes  # only the shared buffers
    for shard in target.shards:  # the fast paths refuse outright
        assert shard.caches.pool.shared_capture


def test_shared_buffers_refuse_the_fast_restores(
    tiny: TargetModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    with failing_allocation(monkeypatch, full_checkpoints, OOM_ERRORS[0]):
        target = _target(tiny)
    target.forward(PROMPT, "prefill", 0)
    target.forward([1, 2, 3, 4], "verify", len(PROMPT), geometry=chain_of(4))
    for shard in target.shards:
        pool = shard.caches.pool
        with pytest.raises(CacheError, match="fast rollback is unavailable"):
            pool.mark_device_rollback("checkpoint")
        pool.restore_pre_verify()  # the replay path's way back still works
        assert pool.length == len(PROMPT)


def test_the_reason_is_in_the_generation_result(
    tiny: TargetModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    plan = plan_shards(6, "cpu")
    with failing_allocation(monkeypatch, full_checkpoints, OOM_ERRORS[0]):
        result = generate(
            tiny, PromptLookupDrafter(), PROMPT, plan=plan, max_new_tokens=10, block_size=4,
            policy=RollbackPolicy(mode="checkpoint"), check_parity=True,
        )
    assert result.parity is True
    assert result.rollback.status is RollbackStatus.REQUESTED
    assert result.rollback.fast == 0 and result.rollback.replay == result.steps
    reason = result.rollback.fast_unavailable_reason
    assert reason is not None and "could not be allocated on cpu" in reason
    plain = generate(tiny, PromptLookupDrafter(), PROMPT, plan=plan, max_new_tokens=10,
                     block_size=4, policy=RollbackPolicy(mode="checkpoint"))
    assert plain.rollback.fast_unavailable_reason is None
    assert plain.rollback.status is RollbackStatus.EFFECTIVE


def test_a_rebuild_that_does_not_fit_falls_back_to_replay_and_a_later_one_recovers(
    tiny: TargetModel, greedy: Callable[[str, int], list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    oracle = greedy("digits", 3 * N)
    engine = _engine(tiny, _target(tiny), oracle, "checkpoint")
    out = _decode(engine, N)
    assert engine.status is RollbackStatus.EFFECTIVE and engine.counts["fast"] > 0
    with failing_allocation(monkeypatch, full_checkpoints, OOM_ERRORS[0]):
        engine.rebuild_storage()
    # the cast: mypy would keep the status narrowed by the assert above across the rebuild
    assert cast(RollbackStatus, engine.status) is RollbackStatus.REQUESTED
    assert engine.fast_unavailable_reason is not None
    fast_before, steps_before = engine.counts["fast"], len(engine.records)
    while len(out) < 2 * N:
        out.extend(engine.step())
    assert engine.counts["fast"] == fast_before  # every step after the rebuild replayed
    assert engine.counts["replay"] >= len(engine.records) - steps_before
    engine.rebuild_storage()  # the memory is back: the gate validates again
    while len(out) < 3 * N:
        out.extend(engine.step())
    assert out[: 3 * N] == oracle[: 3 * N]
    assert engine.fast_unavailable_reason is None
    assert engine.status is RollbackStatus.EFFECTIVE and engine.counts["fast"] > fast_before


@pytest.mark.parametrize(
    "refuse, what",
    [
        (lambda what, shape: what == "checkpoints", "shared verify buffers"),
        (lambda what, shape: what == "snapshot", "pre-verify snapshot"),
    ],
    ids=["no-shared-buffers", "no-snapshot"],
)
def test_no_room_even_for_replay_is_a_typed_error(
    tiny: TargetModel,
    monkeypatch: pytest.MonkeyPatch,
    refuse: Callable[[str, tuple[int, ...]], bool],
    what: str,
) -> None:
    with (
        failing_allocation(monkeypatch, refuse, OOM_ERRORS[0]),
        pytest.raises(CaptureStorageError, match=what) as info,
    ):
        _target(tiny)
    assert isinstance(info.value, ExecutionError)
    assert "could not be allocated on cpu" in str(info.value)


def test_an_allocation_bug_is_not_taken_for_out_of_memory(
    tiny: TargetModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    bug = RuntimeError("expected a sequence of ints")
    with (
        failing_allocation(monkeypatch, full_checkpoints, bug),
        pytest.raises(RuntimeError, match="sequence of ints"),
    ):
        _target(tiny)


def _short_model(tiny: TargetModel, positions: int) -> TargetModel:
    config = tiny.config.model_copy(update={"max_position_embeddings": positions})
    return TargetModel.seeded(config, seed=0, dtype=torch.float32, device="cpu")


def test_positions_needed_is_the_last_verify_end() -> None:
    # the last step starts with max_new_tokens-1 tokens out: committed = P + N - 2,
    # and its verify covers B positions from there
    assert positions_needed(6, 8, 4) == 6 + 8 - 2 + 4


@pytest.mark.parametrize("budget, refused", [(12, False), (13, True)])
def test_a_budget_past_max_position_is_refused_before_decoding(
    tiny: TargetModel, monkeypatch: pytest.MonkeyPatch, budget: int, refused: bool
) -> None:
    model = _short_model(tiny, 6 + 12 + 4 - 2)  # exactly fits max_new_tokens=12
    drafter = PromptLookupDrafter()
    forwards: list[str] = []
    real = TargetModel.compute_layers

    def counting(self: TargetModel, hidden, layers, caches, mode, *args, **kwargs):  # type: ignore[no-untyped-def]
        forwards.append(mode)
        return real(self, hidden, layers, caches, mode, *args, **kwargs)

    monkeypatch.setattr(TargetModel, "compute_layers", counting)
    plan = plan_shards(6, "cpu")
    if not refused:
        result = generate(model, drafter, PROMPT, plan=plan, max_new_tokens=budget, block_size=4)
        assert len(result.tokens) == budget
        return
    with pytest.raises(ContextLengthError) as info:
        generate(model, drafter, PROMPT, plan=plan, max_new_tokens=budget, block_size=4)
    assert forwards == []  # refused before the prefill
    message = str(info.value)
    assert "6 tokens" in message and "max_new_tokens=13" in message
    assert "21 positions" in message and "max_position_embeddings=20" in message
    assert isinstance(info.value, ExecutionError) and isinstance(info.value, UsageError)
