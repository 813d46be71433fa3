"""Sampled steps on a GPU at the 9B widths (skipped without CUDA): every emitted token is
plain sampled decoding's — the seeded rule at the same absolute positions — for chains
(CUDA-graphed steps, the device's acceptance) and trees, in every rollback mode.

Run: ``python -m pytest tests/gpu/test_sampled.py -q -s``
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
from dflash.model.drafters import SyntheticDrafter
from dflash.model.drafters.trees import SyntheticTreeDrafter
from dflash.sampling import SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
BLOCK, BUDGET, N = 8, 24, 96
RULE = SamplingParams(temperature=0.8, top_k=50, top_p=0.95, min_p=0.01, seed=11)
#: top-p alone (with min-p): the filters' coarse mass pass, whose cut may lie deep in a row
RULE_P = SamplingParams(temperature=1.0, top_p=0.9, min_p=0.001, seed=12)


@pytest.fixture(scope="module")
def model() -> TargetModel:
    nine = HybridConfig.nine_b_shape()  # its first 8 layers: 3 recurrent + 1 attention, twice
    config = HybridConfig(**{**nine.model_dump(), "layer_types": nine.layer_types[:8]})
    return TargetModel.seeded(config, seed=0, dtype=torch.bfloat16, device="cuda:0")


@pytest.mark.parametrize("rule", [RULE, RULE_P], ids=["k-p-min", "p-min"])
@pytest.mark.parametrize("tree", [False, True])
@pytest.mark.parametrize("mode", ["checkpoint", "remap", "replay", "recompute"])
@torch.inference_mode()
def test_sampled_steps_are_plain_sampled_decoding(
    model: TargetModel, mode: RollbackMode, tree: bool, rule: SamplingParams
) -> None:
    rng = random.Random(5)
    prompt = [rng.randrange(model.config.vocab_size) for _ in range(200)]
    plan = plan_shards(model.config.num_hidden_layers, "cuda:0")
    oracle = reference_greedy(model, plan, prompt, N + BUDGET, sampling=rule)
    greedy = reference_greedy(model, plan, prompt, N)
    assert oracle[:N] != greedy
    target = ShardedTarget(model, plan, max_len=len(prompt) + N + BUDGET + 1, max_draft=BUDGET)
    vocab = model.config.vocab_size
    drafter = (
        SyntheticTreeDrafter(prompt + oracle, (0.5, 0.2, 0.1, 0.05), vocab, seed=3)
        if tree else SyntheticDrafter(prompt + oracle, 0.8, vocab, seed=3)
    )
    engine = SpecDecoder(
        target, drafter, block_size=BLOCK, policy=RollbackPolicy(mode=mode),
        tree_budget=BUDGET if tree else None, sampling=rule,
    )
    out = [engine.prefill(prompt)]
    while len(out) < N:
        out.extend(engine.step())
    assert out[:N] == oracle[:N]
    steps = engine.records[1:]
    commit = sum(r.accept_n for r in steps) / len(steps)
    print(f"\n{mode} {'tree' if tree else 'chain'}: {len(steps)} steps, commit {commit:.2f}")
    assert commit > 1.5
    if mode != "replay":
        assert engine.status is RollbackStatus.EFFECTIVE and engine.counts["fast"] == len(steps)
    # the acceptance ran inside a CUDA graph that read the verify graph's logits
    graphs = target.graphs
    assert graphs is not None
    assert not graphs[-1].failures, graphs[-1].failures
    kind = "logits:tree" if tree else "logits:chain"
    assert any(k[0] == kind for k in graphs[-1].captured_keys), graphs[-1].captured_keys


@pytest.mark.parametrize("mode", ["checkpoint", "recompute"])
@torch.inference_mode()
def test_coupled_dflash_drafting_on_the_device_is_plain_sampled_decoding(
    model: TargetModel, mode: RollbackMode
) -> None:
    """The DFlash drafter drafts on the device inside the graphs with the target's rule
    and noise (coupled): the tokens are plain sampled decoding's, the drafting step is
    captured, and its guesses differ from the argmax guesses of the same drafter."""
    from dflash.model.drafters import DFlashConfig, DFlashDrafter

    cfg = DFlashConfig.for_target(
        hidden_size=model.config.hidden_size, vocab_size=model.config.vocab_size,
        num_target_layers=8, num_hidden_layers=2, block_size=BLOCK,
    )
    rng = random.Random(9)
    prompt = [rng.randrange(model.config.vocab_size) for _ in range(128)]
    plan = plan_shards(model.config.num_hidden_layers, "cuda:0")
    rule = SamplingParams(temperature=1.0, seed=21)
    oracle = reference_greedy(model, plan, prompt, N + BLOCK, sampling=rule)
    drafts = {}
    for coupled in (True, False):
        drafter = DFlashDrafter.random(cfg, model.embed_tokens.weight, model.lm_head.weight,
                                       seed=4)
        target = ShardedTarget(model, plan, max_len=len(prompt) + N + BLOCK + 1,
                               max_draft=BLOCK)
        engine = SpecDecoder(target, drafter, block_size=BLOCK,
                             policy=RollbackPolicy(mode=mode), sampling=rule)
        assert engine.device_drafter is not None
        if not coupled:  # the same drafter's argmax guesses, for the comparison
            drafter.couple(SamplingParams())
        out = [engine.prefill(prompt)]
        while len(out) < N:
            out.extend(engine.step())
        assert out[:N] == oracle[:N], f"coupled={coupled}"
        graphs = target.graphs
        assert graphs is not None and ("draft", BLOCK, False) in graphs[0].captured_keys
        drafts[coupled] = [r.draft for r in engine.records]
        commit = sum(r.accept_n for r in engine.records) / len(engine.records)
        print(f"\n{mode} dflash on device, coupled={coupled}: commit {commit:.2f}")
    assert drafts[True][0] != drafts[False][0]  # the same pending token, other guesses


@pytest.mark.parametrize("rule", [RULE, RULE_P], ids=["k-p-min", "p-min"])
@torch.inference_mode()
def test_plain_sampled_decoding_draws_the_same_inside_graphs(
    model: TargetModel, rule: SamplingParams
) -> None:
    """The oracle's draws replayed from a CUDA graph on the decode graph's logits equal its
    eager draws without graphs, token for token."""
    rng = random.Random(6)
    prompt = [rng.randrange(model.config.vocab_size) for _ in range(64)]
    plan = plan_shards(model.config.num_hidden_layers, "cuda:0")
    target = ShardedTarget(model, plan, max_len=len(prompt) + 48, max_draft=1)
    graphed = reference_greedy(model, plan, prompt, 48, sampling=rule, target=target)
    assert graphed == reference_greedy(model, plan, prompt, 48, sampling=rule, graphs=False)
    assert target.graphs is not None and not target.graphs[-1].failures
    assert ("logits:decode", 1, False) in target.graphs[-1].captured_keys
