"""GPU: the 9B-shaped seeded model (bf16) — every rollback mode equals target-only greedy.

One H200, and the same model split across two (skipped with fewer than two GPUs): 256
new tokens after a seeded random prompt, synthetic drafter (acceptance 0.6, block 16),
Asserts token identity with plain target-only greedy decoding (the oracle), zero
fallbacks in the fast modes, and equal SHA-256 across modes and across 1 vs 2 GPUs; prints
a summary table with the SHA-256s. Run: ``python -m pytest tests/gpu/test_execution.py -q -s``.
"""

from __future__ import annotations

import random
import time

import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

from dflash.execution import (  # noqa: E402 - after the CUDA skip, as the module needs torch
    ROLLBACK_MODES,
    GenerationResult,
    RollbackPolicy,
    RollbackStatus,
    generate,
    plan_shards,
    reference_greedy,
    token_sha256,
)
from dflash.model import HybridConfig, TargetModel, greedy_generate  # noqa: E402 - as above
from dflash.model.drafters import SyntheticDrafter  # noqa: E402 - as above

NEW_TOKENS = 256
BLOCK = 16
PROMPT_LEN = 128
ACCEPTANCE = 0.6
TOKENS: dict[str, list[int]] = {}  # "1 GPU" / "2 GPUs" -> the oracle's tokens
ROWS: list[tuple[str, str, GenerationResult | None, str, float]] = []


@pytest.fixture(scope="module")
def model() -> TargetModel:
    return TargetModel.seeded(
        HybridConfig.nine_b_shape(), seed=0, dtype=torch.bfloat16, device="cuda:0"
    )


@pytest.fixture(scope="module")
def prompt(model: TargetModel) -> list[int]:
    rng = random.Random(1234)
    return [rng.randrange(model.config.vocab_size) for _ in range(PROMPT_LEN)]


def _first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)


def _all_modes(
    model: TargetModel, prompt: list[int], devices: str, split: str | None, label: str
) -> str:
    plan = plan_shards(model.config.num_hidden_layers, devices, split)
    t0 = time.perf_counter()
    oracle = reference_greedy(model, plan, prompt, NEW_TOKENS + BLOCK)
    ROWS.append(
        (
            label,
            "oracle (plain greedy)",
            None,
            token_sha256(oracle[:NEW_TOKENS]),
            time.perf_counter() - t0,
        )
    )
    TOKENS[label] = oracle[:NEW_TOKENS]
    drafter = SyntheticDrafter(prompt + oracle, ACCEPTANCE, model.config.vocab_size, seed=7)
    shas = set()
    for mode in ROLLBACK_MODES:
        t0 = time.perf_counter()
        r = generate(
            model,
            drafter,
            prompt,
            plan=plan,
            max_new_tokens=NEW_TOKENS,
            block_size=BLOCK,
            policy=RollbackPolicy(mode=mode),
        )
        ROWS.append((label, mode, r, r.sha256, time.perf_counter() - t0))
        first_diff = _first_difference(r.tokens, oracle)
        assert r.tokens == oracle[:NEW_TOKENS], f"{label} {mode}: first difference at {first_diff}"
        assert r.rollback.replay_after_failure == 0 and r.rollback.poison_events == 0
        if mode == "replay":
            assert r.rollback.status is RollbackStatus.OFF
        else:
            assert r.capture.verdict == "validated", r.capture.reason
            assert r.rollback.status is RollbackStatus.EFFECTIVE
            assert r.rollback.fast == r.steps - 1 and r.rollback.replay == 1  # gate step only
        shas.add(r.sha256)
    assert len(shas) == 1, f"{label}: SHA-256 differs across modes: {shas}"
    return shas.pop()


def _print_table() -> None:
    print("\nsetup | mode | sha256 | steps | accept | fwd/step | fast/replay/fail | tok/s | wall s")
    for label, mode, r, sha, wall in ROWS:
        if r is None:
            print(f"{label} | {mode} | {sha} | - | - | - | - | - | {wall:.1f}")
        else:
            print(
                f"{label} | {mode} | {sha} | {r.steps} | {r.acceptance_rate:.3f} | "
                f"{r.target_forwards_per_step:.2f} | {r.rollback.fast}/{r.rollback.replay}/"
                f"{r.rollback.replay_after_failure} | {r.timings.tokens_per_s:.1f} | {wall:.1f}"
            )


@pytest.fixture(scope="module")
def one_gpu_sha(model: TargetModel, prompt: list[int]) -> str:
    """Every mode on one GPU (asserted equal to greedy); their common SHA-256.

    A fixture, so the two-GPU test computes the one-GPU reference itself when it runs
    alone (``-k two_gpus``) and shares it when both tests run.
    """
    return _all_modes(model, prompt, "cuda:0", None, "1 GPU")


def test_one_gpu_all_modes_equal_greedy(
    model: TargetModel, prompt: list[int], one_gpu_sha: str
) -> None:
    assert one_gpu_sha == token_sha256(TOKENS["1 GPU"]), "every mode's SHA is the oracle's"
    # the one-shard model-level oracle is the same plain greedy decoding
    plain = greedy_generate(model, prompt, NEW_TOKENS)
    same = _first_difference(plain, TOKENS["1 GPU"])
    assert plain == TOKENS["1 GPU"], f"greedy_generate differs first at token {same}"
    _print_table()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_two_gpus_split_equals_one(model: TargetModel, prompt: list[int], one_gpu_sha: str) -> None:
    half = model.config.num_hidden_layers // 2
    sha2 = _all_modes(model, prompt, "cuda:0,cuda:1", f"{half},{half}", "2 GPUs")
    _print_table()
    first = _first_difference(TOKENS["2 GPUs"], TOKENS["1 GPU"])
    assert TOKENS["2 GPUs"] == TOKENS["1 GPU"], f"oracles differ first at token {first}"
    assert sha2 == one_gpu_sha, f"1 GPU {one_gpu_sha} != 2 GPUs {sha2}"
