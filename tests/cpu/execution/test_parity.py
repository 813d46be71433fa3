"""Parity: speculative output equals plain target-only greedy decoding, bit for bit.

The oracle is ``greedy_generate``: prefill, then one ``decode`` forward per token, no
capture storage. Every rollback mode, every drafter, float32 and bfloat16, several
prompts, block sizes 2, 4 and 16; the synthetic drafter with acceptance 1 gives
all-accepted steps, with 0 none-accepted steps (both asserted to have happened, so the
edge cases are really exercised).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from dflash.execution import (
    ROLLBACK_MODES,
    GenerationResult,
    RollbackMode,
    RollbackPolicy,
    RollbackStatus,
    generate,
    plan_shards,
    reference_greedy,
    token_sha256,
)
from dflash.model import TargetModel
from dflash.model.drafters import Drafter, SyntheticDrafter, make_drafter

PROMPTS: dict[str, list[int]] = {}


@pytest.fixture(autouse=True)
def _prompts(prompts: dict[str, list[int]]) -> None:
    PROMPTS.update(prompts)


N = 12
DTYPES = ("float32", "bfloat16")
CASES = [  # (prompt, block size, acceptance)
    ("digits", 2, 0.0),
    ("short", 4, 0.6),
    ("repeat", 16, 1.0),
    ("digits", 16, 0.5),
]


def _run(
    model: TargetModel,
    drafter: Drafter,
    prompt: str,
    block: int,
    mode: RollbackMode,
    *,
    n: int = N,
    devices: str = "cpu",
    split: str | None = None,
) -> GenerationResult:
    return generate(
        model,
        drafter,
        PROMPTS[prompt],
        plan=plan_shards(6, devices, split),
        max_new_tokens=n,
        block_size=block,
        policy=RollbackPolicy(mode=mode),
    )


def _synthetic(model: TargetModel, prompt: str, oracle: list[int], p: float) -> Drafter:
    # the drafter's oracle reaches a block past the budget, so p=1 accepts every slot
    return SyntheticDrafter(PROMPTS[prompt] + oracle, p, model.config.vocab_size, seed=3)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", ROLLBACK_MODES)
@pytest.mark.parametrize(("prompt", "block", "p"), CASES)
def test_every_mode_matches_plain_greedy(
    tiny_of: Callable[[str], TargetModel],
    greedy: Callable[..., list[int]],
    dtype: str,
    mode: RollbackMode,
    prompt: str,
    block: int,
    p: float,
) -> None:
    model = tiny_of(dtype)
    oracle = greedy(prompt, N + block, dtype)
    result = _run(model, _synthetic(model, prompt, oracle, p), prompt, block, mode)
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
        # every verified token committed (on CPU a window may end early, at a tile boundary)
        assert result.avg_commit == (result.drafted_tokens + result.steps) / result.steps
    if p == 0.0:
        assert result.acceptance_rate == 0.0 and result.avg_commit == 1.0  # none accepted


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("draft", ["prompt-lookup", "dflash"])
def test_every_drafter_matches_plain_greedy(
    tiny_of: Callable[[str], TargetModel],
    greedy: Callable[..., list[int]],
    dtype: str,
    draft: str,
) -> None:
    model = tiny_of(dtype)
    oracle = greedy("repeat", 20, dtype)
    drafter = make_drafter(draft, model, seed=0)
    for mode in ROLLBACK_MODES:
        result = _run(model, drafter, "repeat", 4, mode, n=20)
        assert result.tokens == oracle, (draft, mode)


def test_bfloat16_longer_run_with_partial_acceptance(
    tiny_of: Callable[[str], TargetModel], greedy: Callable[..., list[int]]
) -> None:
    """bf16 over more steps: many verify rows, every accepted length, every mode."""
    model = tiny_of("bfloat16")
    oracle = greedy("digits", 48 + 8, "bfloat16")
    for mode in ROLLBACK_MODES:
        result = _run(model, _synthetic(model, "digits", oracle, 0.7), "digits", 8, mode, n=48)
        assert result.tokens == oracle[:48], mode
        assert 0.0 < result.acceptance_rate < 1.0 and result.steps > 8, mode


@pytest.mark.parametrize("mode", ROLLBACK_MODES)
def test_split_across_two_cpu_shards_equals_unsplit(
    tiny: TargetModel, greedy: Callable[..., list[int]], mode: RollbackMode
) -> None:
    oracle = greedy("digits", N + 4)
    drafter = _synthetic(tiny, "digits", oracle, 0.6)
    one = _run(tiny, drafter, "digits", 4, mode)
    two = _run(tiny, drafter, "digits", 4, mode, devices="cpu,cpu", split="2,4")
    assert two.tokens == one.tokens == oracle[:N]
    assert two.layer_split == [2, 4] and two.devices == ["cpu", "cpu"]
    assert len(two.capture.shards) == (2 if mode != "replay" else 0)
    assert two.checkpoint_bytes == one.checkpoint_bytes  # same storage, split over two shards


@pytest.mark.parametrize("dtype", DTYPES)
def test_sharded_oracle_equals_greedy_generate(
    tiny_of: Callable[[str], TargetModel], greedy: Callable[..., list[int]], dtype: str
) -> None:
    for name in ("digits", "short"):
        sharded = reference_greedy(
            tiny_of(dtype), plan_shards(6, "cpu,cpu", "3,3"), PROMPTS[name], N
        )
        assert sharded == greedy(name, N, dtype)


def test_check_parity_reports_true_and_the_oracle_sha(
    tiny: TargetModel, greedy: Callable[..., list[int]]
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


class _Scribbler:
    """A drafter that proposes the synthetic drafter's guesses, then empties the context
    it was handed and fills it with token 0 (a drafter may do anything to its argument)."""

    def __init__(self, inner: Drafter) -> None:
        self.inner = inner
        self.label = "scribbler"
        self.tap_layers: tuple[int, ...] = ()
        self.seen: list[int] = []

    def propose(self, context: list[int], last: int, block_size: int,
                features: object = None) -> list[int]:
        guesses = self.inner.propose(context, last, block_size, None)
        self.seen.append(len(context))
        context[:] = [0] * (len(context) + 3)
        return guesses


@pytest.mark.parametrize("mode", ROLLBACK_MODES)
def test_a_drafter_that_rewrites_its_context_changes_nothing(
    tiny_of: Callable[[str], TargetModel], greedy: Callable[..., list[int]], mode: RollbackMode,
) -> None:
    """The engine hands a host drafter a copy of its committed tokens (never its own
    list, which it does not copy for sources that do not read it): a drafter that rewrites
    the list it was handed leaves the engine's context, the positions it drafts at and
    the output as they were."""
    model = tiny_of("float32")
    oracle = greedy("digits", 16 + 4, "float32")
    drafter = _Scribbler(_synthetic(model, "digits", oracle, 0.6))
    result = _run(model, drafter, "digits", 4, mode, n=16)
    assert result.tokens == oracle[:16]
    prompt = len(PROMPTS["digits"])
    assert drafter.seen[0] == prompt and drafter.seen == sorted(set(drafter.seen))
