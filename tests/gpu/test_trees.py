"""Tree steps on a GPU at the 9B widths (skipped without CUDA): every tree step's emitted
tokens are plain greedy decoding's, bit for bit, in the fast modes and on replay, and
graphs (the chain gate step) mix with eager tree verifies.

Run: ``python -m pytest tests/gpu/test_trees.py -q -s``
"""

from __future__ import annotations

import random

import pytest
import torch

from dflash.execution import (
    RollbackMode,
    RollbackPolicy,
    RollbackStatus,
    ShardedTarget,
    SpecDecoder,
    plan_shards,
    reference_greedy,
)
from dflash.model import HybridConfig, TargetModel
from dflash.model.drafters.trees import SyntheticTreeDrafter

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
BLOCK, BUDGET, N = 8, 24, 96
RANKS = (0.5, 0.2, 0.1, 0.05)


@pytest.fixture(scope="module")
def model() -> TargetModel:
    nine = HybridConfig.nine_b_shape()  # its first 8 layers: 3 recurrent + 1 attention, twice
    config = HybridConfig(**{**nine.model_dump(), "layer_types": nine.layer_types[:8]})
    return TargetModel.seeded(config, seed=0, dtype=torch.bfloat16, device="cuda:0")


@pytest.mark.parametrize("mode", ["checkpoint", "remap", "replay"])
@torch.inference_mode()
def test_tree_steps_are_plain_greedy(model: TargetModel, mode: RollbackMode) -> None:
    rng = random.Random(5)
    prompt = [rng.randrange(model.config.vocab_size) for _ in range(200)]
    plan = plan_shards(model.config.num_hidden_layers, "cuda:0")
    oracle = reference_greedy(model, plan, prompt, N + BUDGET)
    target = ShardedTarget(model, plan, max_len=len(prompt) + N + BUDGET + 1, max_draft=BUDGET)
    drafter = SyntheticTreeDrafter(prompt + oracle, RANKS, model.config.vocab_size, seed=3)
    engine = SpecDecoder(
        target, drafter, block_size=BLOCK, policy=RollbackPolicy(mode=mode),
        tree_budget=BUDGET,
    )
    out = [engine.prefill(prompt)]
    while len(out) < N:
        out.extend(engine.step())
    assert out[:N] == oracle[:N]
    trees = engine.records[1:]
    commit = sum(r.accept_n for r in trees) / len(trees)
    print(f"\n{mode}: {len(trees)} tree steps, {BUDGET}-node trees, average commit {commit:.2f}")
    assert commit > 1.5
    if mode != "replay":
        assert engine.status is RollbackStatus.EFFECTIVE and engine.counts["fast"] == len(trees)
