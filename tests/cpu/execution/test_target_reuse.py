"""A ShardedTarget kept across generations: same tokens as fresh ones, refused when it
cannot serve the run (naming why), and its CUDA graphs forgotten once the weights moved."""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import pytest
import torch

from dflash.execution import (
    RollbackMode,
    RollbackPolicy,
    ShardedTarget,
    SpecDecoder,
    generate,
    plan_shards,
)
from dflash.execution.faults import FaultInjector
from dflash.execution.graphs import ShardGraphs, ShardOutput
from dflash.execution.oracle import reference_greedy
from dflash.execution.policy import RollbackStatus
from dflash.execution.results import GenerationResult
from dflash.execution.run import timed_greedy
from dflash.model import TargetModel, greedy_generate
from dflash.model.drafters import PromptLookupDrafter
from dflash.model.layers import MLP

PROMPTS = ([5, 17, 200, 3, 5, 17, 200, 3, 9], [1, 2, 3, 1, 2, 3, 1, 2], [42] * 6)


@pytest.fixture(scope="module")
def tiny() -> TargetModel:
    return TargetModel.tiny_default(seed=2)


@pytest.mark.parametrize("mode", ["replay", "checkpoint", "remap", "recompute"])
def test_a_kept_target_gives_the_fresh_tokens(
    tiny: TargetModel, mode: RollbackMode, monkeypatch: pytest.MonkeyPatch
) -> None:
    plan = plan_shards(6, "cpu,cpu", "2,4")
    kept = ShardedTarget(tiny, plan, max_len=64, max_draft=8)
    greedy_kept = ShardedTarget(tiny, plan, max_len=64, max_draft=1)
    built: list[ShardedTarget] = []
    real_init = ShardedTarget.__init__

    def counting_init(self: ShardedTarget, *args: object, **kwargs: object) -> None:
        built.append(self)
        real_init(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(ShardedTarget, "__init__", counting_init)
    for prompt in (*PROMPTS, PROMPTS[0]):  # a longer prompt after shorter ones, then again
        policy = RollbackPolicy(mode=mode)
        fresh = generate(tiny, PromptLookupDrafter(), prompt, plan=plan, max_new_tokens=12,
                         block_size=4, policy=policy)
        oracle = greedy_generate(tiny, prompt, 12)
        built.clear()
        again = generate(tiny, PromptLookupDrafter(), prompt, plan=plan, max_new_tokens=12,
                         block_size=4, policy=policy, target=kept, check_parity=True,
                         oracle_tokens=oracle)
        assert built == []  # the run went through the kept target
        assert again.tokens == fresh.tokens == oracle
        assert again.parity is True and again.steps == fresh.steps
        assert again.rollback.status == fresh.rollback.status
        assert reference_greedy(tiny, plan, prompt, 12, target=greedy_kept) == fresh.tokens
        assert timed_greedy(tiny, plan, prompt, 12, target=kept).tokens == fresh.tokens


def test_a_target_that_cannot_serve_is_refused_with_the_reason(tiny: TargetModel) -> None:
    plan = plan_shards(6)
    kept = ShardedTarget(tiny, plan, max_len=24, max_draft=4)
    prompt = PROMPTS[0]

    def run(**kw: object) -> None:
        args = {"plan": plan, "max_new_tokens": 4, "block_size": 4, "target": kept, **kw}
        generate(tiny, PromptLookupDrafter(), prompt, **args)  # type: ignore[arg-type]

    with pytest.raises(ValueError, match="holds 24 positions, the generation needs 28"):
        run(max_new_tokens=14)
    with pytest.raises(ValueError, match="captures 4 slots, the generation needs 8"):
        run(block_size=8)
    with pytest.raises(ValueError, match="layer split"):
        run(plan=plan_shards(6, "cpu,cpu", "3,3"))
    with pytest.raises(ValueError, match="another model"):
        generate(TargetModel.tiny_default(seed=3), PromptLookupDrafter(), prompt, plan=plan,
                 max_new_tokens=4, block_size=4, target=kept)
    with pytest.raises(ValueError, match="graphs=True"):
        run(graphs=True)
    with pytest.raises(ValueError, match="greedy decode: it holds 24"):
        reference_greedy(tiny, plan, prompt, 40, target=kept)
    run()  # the refusals changed nothing: the target still serves a run that fits


def _noted(work: Callable[[], object]) -> tuple[Callable[[], None], ShardOutput]:
    raise AssertionError("no capture runs in this test")


def test_graphs_are_forgotten_when_the_weights_change(tiny: TargetModel) -> None:
    model = TargetModel.tiny_default(seed=4)
    plan = plan_shards(6)
    target = ShardedTarget(model, plan, max_len=32, max_draft=4)
    graphs = ShardGraphs(torch.device("cpu"), capture=_noted)
    graphs._graphs[("verify", 4, True)] = object()  # type: ignore[assignment]  # a stand-in graph
    target.graphs = [graphs]
    target.forward(PROMPTS[1], "prefill", 0)  # same weights: the graph is kept
    assert graphs._graphs
    layer = cast(MLP, model.layers[0].mlp).down_proj  # the tiny model's MLPs are dense
    layer.load_state_dict({"weight": layer.weight.detach().clone()}, assign=True)
    target.forward(PROMPTS[1], "prefill", 0)  # a replaced parameter: graphs would read freed memory
    assert not graphs._graphs


def test_a_kept_engine_serves_later_generations_and_is_refused_elsewhere(
    tiny: TargetModel,
) -> None:
    plan = plan_shards(6, "cpu,cpu", "2,4")
    target = ShardedTarget(tiny, plan, max_len=64, max_draft=4)
    drafter, policy = PromptLookupDrafter(), RollbackPolicy(mode="checkpoint")
    engine = SpecDecoder(target, drafter, block_size=4, policy=policy)

    def run(prompt: list[int], **kw: object) -> GenerationResult:
        args: dict[str, object] = {
            "plan": plan, "max_new_tokens": 12, "block_size": 4, "policy": policy,
            "target": target, "engine": engine, "check_parity": True, **kw,
        }
        return generate(tiny, args.pop("drafter", drafter), prompt, **args)  # type: ignore[arg-type]  # the test's keywords

    first = run(PROMPTS[0])
    second = run(PROMPTS[1])
    for prompt, got in ((PROMPTS[0], first), (PROMPTS[1], second)):
        assert got.parity is True and got.tokens == greedy_generate(tiny, prompt, 12)
    assert first.rollback.status_at_start is RollbackStatus.REQUESTED
    assert first.rollback.replay == 1 and first.capture.verdict == "validated"
    # the verdict carried over: every step of the second generation rolled back fast
    assert second.rollback.status_at_start is RollbackStatus.EFFECTIVE
    assert second.rollback.replay == 0 and second.rollback.fast == second.steps
    assert second.target_forwards == second.steps  # one forward a fast step, no gate replay
    # each reports its own steps; the engine keeps the last generation's records only
    assert first.steps + second.steps == engine.steps_run
    assert second.steps == len(engine.records)
    refusals: list[tuple[dict[str, object], str]] = [
        ({"target": None}, "another target"),
        ({"drafter": PromptLookupDrafter()}, "another drafter"),
        ({"block_size": 2}, "its block size is 4, not 2"),
        ({"policy": RollbackPolicy(mode="remap")}, "rollback mode is 'checkpoint', not 'remap'"),
        ({"faults": FaultInjector()}, "'faults' gets a new engine"),
        ({"verify_window": "full"}, "its verify window is 'auto', not 'full'"),
        ({"engine": object()}, "must be a SpecDecoder"),
    ]
    for kw, match in refusals:
        with pytest.raises(ValueError, match=match):
            run(PROMPTS[2], **kw)
    assert run(PROMPTS[2]).rollback.replay == 0  # the refusals left the engine usable
