"""Sampled speculative decoding: every step's tokens are plain sampled decoding's — the
same seeded rule at the same absolute positions — in every rollback mode, for chains and
trees, float32 and bfloat16, with drafters that guess the sampled tokens and with ones
that guess others; the same seed gives the same text and another seed another."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from dflash.execution import (
    RollbackMode,
    RollbackPolicy,
    RollbackStatus,
    ShardedTarget,
    SpecDecoder,
    plan_shards,
    reference_greedy,
)
from dflash.model import TargetModel
from dflash.model.drafters import (
    DFlashConfig,
    DFlashDrafter,
    PromptLookupDrafter,
    SyntheticDrafter,
)
from dflash.model.drafters.trees import SyntheticTreeDrafter
from dflash.sampling import SamplingParams

PROMPT = "repeat"
N = 24
BLOCK = 5
MODES: list[RollbackMode] = ["replay", "checkpoint", "remap", "recompute"]
RULE = SamplingParams(temperature=0.9, top_k=50, top_p=0.95, seed=17)


def _plain(model: TargetModel, prompt: list[int], n: int, rule: SamplingParams) -> list[int]:
    return reference_greedy(model, plan_shards(6, "cpu"), prompt, n, sampling=rule)


def _decode(engine: SpecDecoder, prompt: list[int], n: int) -> list[int]:
    out = [engine.prefill(prompt)]
    while len(out) < n:
        out.extend(engine.step())
    return out[:n]


def _dflash(model: TargetModel) -> DFlashDrafter:
    """A seeded DFlash drafter of the tiny target's shape (it couples: CoupledDrafter)."""
    cfg = DFlashConfig.for_target(hidden_size=64, vocab_size=256, num_target_layers=6,
                                  num_hidden_layers=2, block_size=BLOCK)
    return DFlashDrafter.random(cfg, model.embed_tokens.weight, model.lm_head.weight, seed=2)


def _target(model: TargetModel, split: str, slots: int) -> ShardedTarget:
    devices = ",".join(["cpu"] * len(split.split(",")))
    return ShardedTarget(model, plan_shards(6, devices, split), max_len=64, max_draft=slots)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("mode", MODES)
def test_chain_steps_draw_plain_sampled_decodings_tokens(
    tiny_of: Callable[[str], TargetModel], prompts: dict[str, list[int]],
    mode: RollbackMode, dtype: str,
) -> None:
    """A drafter that knows the sampled continuation (accepted often) and prompt lookup
    (whose guesses are greedy-like copies): both emit exactly plain sampled decoding."""
    model = tiny_of(dtype)
    prompt = prompts[PROMPT]
    oracle = _plain(model, prompt, N + BLOCK, RULE)
    assert oracle != reference_greedy(model, plan_shards(6, "cpu"), prompt, N + BLOCK)
    knowing = SyntheticDrafter(prompt + oracle, 0.8, model.config.vocab_size, seed=2)
    for drafter in (knowing, PromptLookupDrafter()):
        engine = SpecDecoder(_target(model, "2,4", BLOCK), drafter, block_size=BLOCK,
                             policy=RollbackPolicy(mode=mode), sampling=RULE)
        assert _decode(engine, prompt, N) == oracle[:N]
        if drafter is knowing:
            assert any(r.accept_n > 1 for r in engine.records)
            if mode != "replay":
                assert engine.status is RollbackStatus.EFFECTIVE


@pytest.mark.parametrize("mode", MODES)
def test_tree_steps_draw_plain_sampled_decodings_tokens(
    tiny: TargetModel, prompts: dict[str, list[int]], mode: RollbackMode
) -> None:
    """A tree's node ``u`` draws the token at ``committed + depth(u) + 1``: accepted paths
    through later siblings still give plain sampled decoding's tokens."""
    prompt = prompts[PROMPT]
    oracle = _plain(tiny, prompt, N + 8, RULE)
    drafter = SyntheticTreeDrafter(prompt + oracle, (0.45, 0.25, 0.15), tiny.config.vocab_size,
                                   seed=4)
    engine = SpecDecoder(_target(tiny, "3,3", 8), drafter, block_size=6,
                         policy=RollbackPolicy(mode=mode), tree_budget=8, sampling=RULE)
    assert _decode(engine, prompt, N) == oracle[:N]
    assert any(r.nodes > r.accept_n > 1 for r in engine.records[1:])


def test_the_seed_decides_the_text(
    tiny: TargetModel, prompts: dict[str, list[int]]
) -> None:
    """The same seed gives the same tokens from a new engine; other seeds give others;
    temperature 0 is greedy decoding."""
    prompt = prompts["digits"]

    def run(rule: SamplingParams) -> list[int]:
        engine = SpecDecoder(_target(tiny, "6", BLOCK), PromptLookupDrafter(), block_size=BLOCK,
                             policy=RollbackPolicy(mode="checkpoint"), sampling=rule)
        return _decode(engine, prompt, N)

    first = run(SamplingParams(temperature=1.0, seed=5))
    assert run(SamplingParams(temperature=1.0, seed=5)) == first
    others = [run(SamplingParams(temperature=1.0, seed=s)) for s in (6, 7)]
    assert all(o != first for o in others) and others[0] != others[1]
    assert run(SamplingParams()) == reference_greedy(tiny, plan_shards(6, "cpu"), prompt, N)


def test_sampling_must_be_sampling_params(tiny: TargetModel) -> None:
    with pytest.raises(ValueError, match="'sampling' must be a SamplingParams"):
        SpecDecoder(_target(tiny, "6", BLOCK), PromptLookupDrafter(), block_size=BLOCK,
                    sampling={"temperature": 1.0})  # type: ignore[arg-type]  # wrong on purpose


@pytest.mark.parametrize("rule", [RULE, SamplingParams()])
def test_the_dflash_drafter_draws_its_guesses_with_the_targets_noise(
    tiny: TargetModel, prompts: dict[str, list[int]], rule: SamplingParams
) -> None:
    """Coupled drafting: the engine hands the drafter its rule, and each guess at position
    ``p`` is the rule's draw from the drafter's own logits with the target's noise at ``p``
    (greedy: the argmax); every token still plain sampled decoding's."""
    import torch

    from dflash.sampling import sample_tokens

    drafter = _dflash(tiny)
    engine = SpecDecoder(_target(tiny, "6", BLOCK), drafter, block_size=BLOCK,
                         policy=RollbackPolicy(mode="checkpoint"), sampling=rule)
    prompt = prompts["digits"]
    out = [engine.prefill(prompt)]
    for _ in range(4):
        committed = engine.committed
        guesses, _ = engine.drafts.take(list(engine.context), engine.last)
        scores = drafter.host._scores
        assert scores is not None
        want = sample_tokens(scores[0], committed + torch.arange(1, BLOCK), rule)
        assert guesses == want.tolist()
        out.extend(engine.step())
    assert out == _plain(tiny, prompt, len(out), rule)


def test_sampled_trees_hold_the_coupled_proposal_as_a_branch(
    tiny: TargetModel, prompts: dict[str, list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Trees grown from a DFlash drafter's candidates under sampling hold its coupled
    proposal whole as one branch (the path plain sampling is likeliest to take); the
    tokens stay plain sampled decoding's."""
    import dflash.execution.engine as engine_module
    from dflash.model.drafters.trees import best_first_tree as grow

    branches: list[list[int] | None] = []

    def recording(*args: object, branch: list[int] | None = None, **kwargs: object) -> object:
        branches.append(None if branch is None else list(branch))
        return grow(*args, branch=branch, **kwargs)  # type: ignore[arg-type]  # best_first_tree's own

    monkeypatch.setattr(engine_module, "best_first_tree", recording)
    drafter = _dflash(tiny)
    proposals: list[list[int]] = []
    propose = drafter.propose

    def recorded(*args: object, **kwargs: object) -> list[int]:
        proposals.append(propose(*args, **kwargs))  # type: ignore[arg-type]  # propose's own
        return proposals[-1]

    monkeypatch.setattr(drafter, "propose", recorded)
    engine = SpecDecoder(_target(tiny, "6", 8), drafter, block_size=BLOCK,
                         policy=RollbackPolicy(mode="checkpoint"), tree_budget=8, sampling=RULE)
    prompt = prompts["digits"]
    out = _decode(engine, prompt, N)
    assert out == _plain(tiny, prompt, N, RULE)
    assert branches and branches == proposals[-len(branches):]
