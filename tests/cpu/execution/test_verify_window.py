"""Tile-aligned verify windows on CPU: a verify that would spill a few rows into a second
16-row position tile stops at the boundary; decoding stays identical to plain greedy."""

from __future__ import annotations

import pytest

from dflash.execution import (
    ExecutionError,
    RollbackMode,
    RollbackPolicy,
    ShardedTarget,
    SpecDecoder,
    generate,
    plan_shards,
)
from dflash.execution.window import (
    DEFAULT_RATE,
    MIN_WINDOW,
    STEP_COST,
    TILE_COST,
    TOKEN_COST,
    WINDOW_MARGIN,
    CpuWindow,
    FullWindow,
    make_window,
    tile_window,
    verify_cost,
)
from dflash.model import TargetModel, greedy_generate
from dflash.model.drafters import PromptLookupDrafter, SyntheticDrafter
from dflash.model.tiles import TILE_ROWS


def test_the_window_rule() -> None:
    assert TILE_ROWS == 16 and MIN_WINDOW == 4
    assert [tile_window(s, 16) for s in (0, 1, 5, 12, 13, 15, 16, 21)] == [
        16, 15, 11, 4, 16, 16, 16, 11,
    ]
    assert tile_window(3, 8) == 8  # the room (13) is not smaller than the block
    assert tile_window(10, 8) == 6  # 6 rows left in the tile
    assert tile_window(14, 8) == 8  # 2 rows left: fewer than MIN_WINDOW, the whole block
    assert tile_window(9, 3) == 3  # blocks up to MIN_WINDOW are never cut
    with pytest.raises(ValueError, match="got -1, 4"):
        tile_window(-1, 4)


def test_the_window_cap_after_a_partly_accepted_step() -> None:
    assert WINDOW_MARGIN == 4
    assert tile_window(0, 16, (2, 16)) == 6  # commit 2 of 16: 2 + 4
    assert tile_window(0, 16, (1, 16)) == 5
    assert tile_window(0, 16, (1, 4)) == 5
    assert tile_window(0, 16, (11, 16)) == 15
    assert tile_window(0, 16, (8, 8)) == 16  # the whole window accepted: no cap
    assert tile_window(12, 16, (3, 9)) == 4  # the tile's room is smaller than the cap
    assert tile_window(0, 3, (1, 3)) == 3  # never below MIN_WINDOW, never above the block
    assert tile_window(0, 16, None) == 16
    for bad in ((0, 4), (5, 4), (-1, 2)):
        with pytest.raises(ValueError, match="1 <= commit_n <= window"):
            tile_window(0, 16, bad)


def test_the_modelled_step_cost() -> None:
    assert verify_cost(0, 1) == STEP_COST == verify_cost(37, 1)
    assert verify_cost(0, 16) == pytest.approx(STEP_COST + 15 * TOKEN_COST)  # one tile
    assert verify_cost(13, 3) == pytest.approx(STEP_COST + 2 * TOKEN_COST)  # rows 13-15
    assert verify_cost(13, 4) == pytest.approx(STEP_COST + 3 * TOKEN_COST + TILE_COST)
    assert verify_cost(31, 16) == verify_cost(15, 16)  # the row in the tile counts
    for bad in ((-1, 1), (0, 0)):
        with pytest.raises(ValueError, match="'start' must be >= 0 and 'window' >= 1"):
            verify_cost(*bad)


def test_the_window_follows_the_drafters_confidence() -> None:
    # within a tile a guess is held while the joint probability up to it is worth its
    # verify: >= DEFAULT_RATE * TOKEN_COST = 0.054
    assert pytest.approx(0.054) == DEFAULT_RATE * TOKEN_COST
    assert tile_window(0, 16, None, [1.0] * 15) == 16
    assert tile_window(0, 16, None, [0.5] * 15) == 5  # 0.5^4 = 0.0625 held, 0.5^5 is not
    assert tile_window(0, 16, None, [0.5] * 15, rate=4.0) == 3  # a dearer cost: 0.25 >= 0.144
    assert tile_window(0, 16, None, [1.0, 1.0, 0.05] + [1.0] * 12) == 3
    assert tile_window(0, 16, None, [0.05] + [1.0] * 14) == 1  # no guess pays its verify
    assert tile_window(0, 16, None, [0.3] + [1.0] * 14) == 16  # each later guess adds 0.3
    # the next tile is entered only when its guesses pay for it as a whole (TILE_COST)
    assert tile_window(14, 16, None, [0.9] * 15) == 16  # 0.9^2 + 0.9^3 + … > the tile
    assert tile_window(14, 16, None, [0.5] * 15) == 2  # 0.25 + 0.125 + … < the tile
    assert tile_window(10, 16, None, [0.95] * 6 + [0.01] * 9) == 6  # the tile's 6 rows
    assert tile_window(0, 16, (1, 16), [0.9] * 15) == 16  # the commit cap gives way to it
    assert tile_window(0, 3, None, [0.01, 0.01]) == 1  # short blocks are cut too
    for bad in ([0.5] * 14, [0.5] * 14 + [1.5], [0.5] * 14 + [float("nan")], [1] * 15):
        with pytest.raises(ValueError, match="15 probabilities in \\[0, 1\\], one per guess"):
            tile_window(0, 16, None, bad)
    for rate in (0.0, -1.0, float("nan"), float("inf"), True, "2"):
        with pytest.raises(ValueError, match="'rate' must be a finite number > 0"):
            tile_window(0, 16, None, [0.5] * 15, rate)  # type: ignore[arg-type]  # on purpose
    assert TILE_COST > TOKEN_COST > 0


class _Scored(SyntheticDrafter):
    """A synthetic drafter that reports a fixed confidence pattern, cycling per step."""

    patterns = ([0.95] * 15, [0.45] * 15, [0.3] + [1.0] * 14, [0.04] * 15)

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]  # SyntheticDrafter's own
        self.calls = 0

    def propose(self, *args: object, **kwargs: object) -> list[int]:
        self.calls += 1
        return super().propose(*args, **kwargs)  # type: ignore[arg-type]  # as above

    def confidence(self) -> list[float] | None:
        return list(self.patterns[(self.calls - 1) % len(self.patterns)])


PROMPT = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]


def _decode(
    tiny: TargetModel, drafter: SyntheticDrafter, mode: RollbackMode, n: int = 60
) -> tuple[list[int], list[int], list[float], SpecDecoder]:
    """Speculative decoding of ``n`` tokens after PROMPT on CPU shards (tile windows on):
    the tokens, each step's start position and window rate, and the engine (its records)."""
    target = ShardedTarget(tiny, plan_shards(6), max_len=len(PROMPT) + n + 20, max_draft=16)
    engine = SpecDecoder(target, drafter, block_size=16,
                         policy=RollbackPolicy(mode=mode))
    out = [engine.prefill(PROMPT)]
    starts, rates = [], []
    while len(out) < n:
        starts.append(engine.committed)
        window = engine.window
        assert isinstance(window, CpuWindow)
        rates.append(window.rate)
        out.extend(engine.step())
    return out[:n], starts, rates, engine


@pytest.mark.parametrize("mode", ["replay", "checkpoint"])
def test_cpu_windows_follow_a_scored_drafters_confidence(
    tiny: TargetModel, mode: RollbackMode
) -> None:
    oracle = greedy_generate(tiny, PROMPT, 60)
    drafter = _Scored(PROMPT + oracle, 0.9, tiny.config.vocab_size, seed=3)
    out, starts, rates, engine = _decode(tiny, drafter, mode)
    assert out == oracle  # a prefix of the draft: the same tokens
    gate_steps = {0} if mode != "replay" else set()
    want = [
        16 if i in gate_steps else tile_window(s, 16, None, _Scored.patterns[i % 4], rates[i])
        for i, s in enumerate(starts)
    ]
    assert [len(r.draft) for r in engine.records] == want
    assert 1 in want and any(2 <= w <= 8 for w in want)  # the unsure steps verified less
    # the rate each window was chosen at: the generation's tokens per modelled cost so far
    prior = 2 * STEP_COST
    tokens = cost = 0.0
    for i, (s, r) in enumerate(zip(starts, engine.records, strict=True)):
        assert rates[i] == pytest.approx((tokens + DEFAULT_RATE * prior) / (cost + prior))
        tokens, cost = tokens + r.accept_n, cost + verify_cost(s, len(r.draft))
    assert rates[0] == pytest.approx(DEFAULT_RATE) and len(set(rates)) > 1


@pytest.fixture(scope="module")
def tiny() -> TargetModel:
    return TargetModel.tiny_default(seed=5)


@pytest.mark.parametrize("mode", ["replay", "checkpoint", "remap", "recompute"])
def test_cpu_steps_verify_tile_aligned_windows_losslessly(
    tiny: TargetModel, mode: RollbackMode
) -> None:
    oracle = greedy_generate(tiny, PROMPT, 60)
    drafter = SyntheticDrafter(PROMPT + oracle, 0.9, tiny.config.vocab_size, seed=3)
    out, starts, _, engine = _decode(tiny, drafter, mode)
    assert out == oracle
    records = engine.records
    windows = [len(r.draft) for r in records]
    gate_steps = {0} if mode != "replay" else set()  # the capture gate verifies the block
    last = [None, *((r.accept_n, len(r.draft)) for r in records[:-1])]
    want = [
        16 if i in gate_steps else tile_window(s, 16, last[i]) for i, s in enumerate(starts)
    ]
    assert windows == want and any(w < 16 for w in windows)
    # some windows were capped below the tile's room by the previous step's commit
    assert any(w < tile_window(s, 16) for w, s in zip(windows[1:], starts[1:], strict=True))


def test_drafted_tokens_count_the_verified_guesses(tiny: TargetModel) -> None:
    prompt = [7, 7, 1, 2, 7, 7, 1, 2, 7, 7, 1]
    r = generate(tiny, PromptLookupDrafter(), prompt, plan=plan_shards(6), max_new_tokens=40,
                 block_size=16, check_parity=True)
    assert r.parity is True
    assert r.drafted_tokens < r.steps * 15  # some windows were cut at a tile boundary
    assert r.acceptance_rate == r.accepted_tokens / r.drafted_tokens


def test_a_full_window_verifies_every_draft_whole(tiny: TargetModel) -> None:
    """``verify_window="full"`` (how a drafter's τ is measured) verifies the whole block on
    CPU, ``"auto"`` cuts windows there; anything else is refused, naming the value."""
    prompt = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]
    oracle = greedy_generate(tiny, prompt, 60)
    for choice in ("auto", "full"):
        drafter = SyntheticDrafter(prompt + oracle, 0.9, tiny.config.vocab_size, seed=3)
        target = ShardedTarget(tiny, plan_shards(6), max_len=len(prompt) + 80, max_draft=16)
        engine = SpecDecoder(target, drafter, block_size=16, verify_window=choice,
                             policy=RollbackPolicy(mode="replay"))
        assert isinstance(engine.window, CpuWindow if choice == "auto" else FullWindow)
        out = [engine.prefill(prompt)]
        while len(out) < 60:
            out.extend(engine.step())
        assert out[:60] == oracle
        whole = all(len(r.draft) == 16 for r in engine.records)
        assert whole is (choice == "full")
    assert isinstance(make_window("auto", ["cuda:0"]), FullWindow)  # on CUDA: whole drafts
    target = ShardedTarget(tiny, plan_shards(6), max_len=32, max_draft=16)
    with pytest.raises(ValueError, match="'verify_window' must be one of auto, full"):
        SpecDecoder(target, PromptLookupDrafter(), verify_window="half")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "bad", [[0.5] * 3, [0.5] * 14 + [2.0], [0.5] * 14 + [float("nan")], (0.5,) * 15, "high"]
)
def test_a_malformed_confidence_is_refused_before_the_verify(
    tiny: TargetModel, bad: object
) -> None:
    prompt = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]
    oracle = greedy_generate(tiny, prompt, 40)

    class Broken(_Scored):
        report: object = bad

        def confidence(self) -> list[float] | None:
            return self.report  # type: ignore[return-value]  # deliberately malformed

    drafter = Broken(prompt + oracle, 0.9, tiny.config.vocab_size, seed=3)
    target = ShardedTarget(tiny, plan_shards(6), max_len=len(prompt) + 60, max_draft=16)
    engine = SpecDecoder(target, drafter, block_size=16, policy=RollbackPolicy(mode="replay"))
    out = [engine.prefill(prompt)]
    with pytest.raises(ExecutionError, match="confidence must be None or 15 probabilities"):
        engine.step()
    assert engine.committed == len(prompt) and not engine.records  # nothing changed
    drafter.report = None  # a drafter with no confidence: the commit-capped window
    while len(out) < 40:
        out.extend(engine.step())
    assert out[:40] == oracle
