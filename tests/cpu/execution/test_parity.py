"""Parity: speculative output equals target-only greedy decoding, token for token.

Every rollback mode, several prompts, block sizes 2, 4 and 16; the synthetic drafter with
acceptance 1 gives all-accepted steps, with 0 none-accepted steps (both are asserted to
have happened, so the edge cases are really exercised).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from dflash.execution import (
    ROLLBACK_MODES,
    RollbackPolicy,
    RollbackStatus,
    generate,
    plan_shards,
    reference_greedy,
    token_sha256,
)
from dflash.model import TargetModel
from dflash.model.drafters import SyntheticDrafter

PROMPTS: dict[str, list[int]] = {}


@pytest.fixture(autouse=True)
def _prompts(prompts: dict[str, list[int]]) -> None:
    PROMPTS.update(prompts)


N = 12
CASES = [  # (prompt, block size, acceptance)
    ("digits", 2, 0.0),
    ("short", 4, 0.6),
    ("repeat", 16, 1.0),
    ("digits", 16, 0.5),
]


def _run(
    tiny: TargetModel,
    oracle: list[int],
    prompt: str,
    block: int,
    p: float,
    mode: str,
    *,
    devices: str = "cpu",
    split: str | None = None,
    deterministic: bool = True,
):
    # the drafter's oracle reaches a block past the budget, so p=1 accepts every slot
    drafter = SyntheticDrafter(PROMPTS[prompt] + oracle, p, tiny.config.vocab_size, seed=3)
    return generate(
        tiny,
        drafter,
        PROMPTS[prompt],
        plan=plan_shards(6, devices, split),
        max_new_tokens=N,
        block_size=block,
        policy=RollbackPolicy(mode=mode, deterministic=deterministic),
    )


@pytest.mark.parametrize("mode", ROLLBACK_MODES)
@pytest.mark.parametrize(("prompt", "block", "p"), CASES)
def test_every_mode_matches_target_only_greedy(
    tiny: TargetModel,
    greedy: Callable[[str, int], list[int]],
    mode: str,
    prompt: str,
    block: int,
    p: float,
) -> None:
    oracle = greedy(prompt, N + block)
    result = _run(tiny, oracle, prompt, block, p, mode)
    assert result.tokens == oracle[:N]
    assert result.sha256 == token_sha256(oracle[:N])
    if mode == "replay":
        assert result.rollback.status is RollbackStatus.OFF
        assert result.rollback.fast == 0 and result.rollback.replay == result.steps
        assert result.target_forwards_per_step == 2.0
    else:
        # the first step runs the capture gate through replay; every later step is fast
        assert result.capture.verdict == "validated"
        assert result.rollback.status is RollbackStatus.EFFECTIVE
        assert result.rollback.status_at_start is RollbackStatus.REQUESTED
        assert result.rollback.replay == 1 and result.rollback.fast == result.steps - 1
        assert result.rollback.replay_after_failure == 0
    if p == 1.0:
        assert result.acceptance_rate == 1.0  # every step all-accepted
        assert result.avg_commit == block
    if p == 0.0:
        assert result.acceptance_rate == 0.0 and result.avg_commit == 1.0  # none accepted


@pytest.mark.parametrize("mode", ROLLBACK_MODES)
def test_split_across_two_cpu_shards_equals_unsplit(
    tiny: TargetModel, greedy: Callable[[str, int], list[int]], mode: str
) -> None:
    oracle = greedy("digits", N + 4)
    one = _run(tiny, oracle, "digits", 4, 0.6, mode)
    two = _run(tiny, oracle, "digits", 4, 0.6, mode, devices="cpu,cpu", split="2,4")
    assert two.tokens == one.tokens == oracle[:N]
    assert two.layer_split == [2, 4] and two.devices == ["cpu", "cpu"]
    assert len(two.capture.shards) == (2 if mode != "replay" else 0)
    assert two.checkpoint_bytes == one.checkpoint_bytes  # same storage, split over two shards


def test_non_deterministic_mode_matches_on_cpu_float32(
    tiny: TargetModel, greedy: Callable[[str, int], list[int]]
) -> None:
    oracle = greedy("repeat", N + 4)
    for mode in ROLLBACK_MODES:
        result = _run(tiny, oracle, "repeat", 4, 0.6, mode, deterministic=False)
        assert result.tokens == oracle[:N], mode
        assert not result.deterministic


def test_deterministic_oracle_equals_plain_greedy(
    tiny: TargetModel, greedy: Callable[[str, int], list[int]]
) -> None:
    for name in ("digits", "short"):
        plain = greedy(name, N)
        fixed_shape = reference_greedy(
            tiny,
            plan_shards(6, "cpu,cpu", "3,3"),
            PROMPTS[name],
            N,
            deterministic=True,
            block_size=4,
        )
        assert fixed_shape == plain


def test_check_parity_reports_true_and_the_oracle_sha(
    tiny: TargetModel, greedy: Callable[[str, int], list[int]]
) -> None:
    oracle = greedy("short", 8)
    drafter = SyntheticDrafter(PROMPTS["short"] + oracle, 0.5, tiny.config.vocab_size, seed=0)
    result = generate(
        tiny,
        drafter,
        PROMPTS["short"],
        plan=plan_shards(6),
        max_new_tokens=8,
        block_size=4,
        policy=RollbackPolicy(mode="remap"),
        check_parity=True,
    )
    assert result.parity is True
    assert result.parity_sha256 == result.sha256 == token_sha256(oracle)
