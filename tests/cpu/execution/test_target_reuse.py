"""A ShardedTarget kept across generations: same tokens as fresh ones, refused when it
cannot serve the run (naming why), and its CUDA graphs forgotten once the weights moved."""

from __future__ import annotations

import pytest
import torch

from dflash.execution import RollbackPolicy, ShardedTarget, SpecDecoder, generate, plan_shards
from dflash.execution.capture_gate import CaptureGate
from dflash.execution.faults import FaultInjector, FaultPhase
from dflash.execution.graphs import ShardGraphs, ShardOutput
from dflash.execution.oracle import reference_greedy
from dflash.execution.policy import RollbackStatus
from dflash.execution.results import GenerationResult
from dflash.execution.run import timed_greedy
from dflash.model import TargetModel, greedy_generate
from dflash.model.drafters import PromptLookupDrafter

PROMPTS = ([5, 17, 200, 3, 5, 17, 200, 3, 9], [1, 2, 3, 1, 2, 3, 1, 2], [42] * 6)


@pytest.fixture(scope="module")
def tiny() -> TargetModel:
    return TargetModel.tiny_default(seed=2)


@pytest.mark.parametrize("mode", ["replay", "checkpoint", "remap"])
def test_a_kept_target_gives_the_fresh_tokens(
    tiny: TargetModel, mode: str, monkeypatch: pytest.MonkeyPatch
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
        policy = RollbackPolicy(mode=mode)  # type: ignore[arg-type]  # a literal of the set
        fresh = generate(tiny, PromptLookupDrafter(), prompt, plan=plan, max_new_tokens=12,
                         block_size=4, policy=policy)
        built.clear()
        again = generate(tiny, PromptLookupDrafter(), prompt, plan=plan, max_new_tokens=12,
                         block_size=4, policy=policy, target=kept, check_parity=True,
                         greedy_target=greedy_kept)
        assert built == []  # both runs went through the kept targets
        assert again.tokens == fresh.tokens == greedy_generate(tiny, prompt, 12)
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


def _noted(work: object) -> tuple[object, ShardOutput]:
    raise AssertionError("no capture runs in this test")


def test_graphs_are_forgotten_when_the_weights_change(tiny: TargetModel) -> None:
    model = TargetModel.tiny_default(seed=4)
    plan = plan_shards(6)
    target = ShardedTarget(model, plan, max_len=32, max_draft=4)
    graphs = ShardGraphs(torch.device("cpu"), capture=_noted)  # type: ignore[arg-type]
    graphs._graphs[("verify", 4, None, True)] = object()  # type: ignore[assignment]  # a captured graph
    target.graphs = [graphs]
    target.forward(PROMPTS[1], "prefill", 0)  # same weights: the graph is kept
    assert graphs._graphs
    layer = model.layers[0].mlp.down_proj
    layer.load_state_dict({"weight": layer.weight.detach().clone()}, assign=True)
    target.forward(PROMPTS[1], "prefill", 0)  # a replaced parameter: graphs would read freed memory
    assert not graphs._graphs


@pytest.mark.parametrize("mode", ["checkpoint", "remap"])
def test_repeats_share_one_engine_whose_gate_runs_once(
    tiny: TargetModel, mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``repeats`` time the speculative decode on one engine, as a long-lived one serves
    requests: the capture gate's self-test runs in the first run only, the other runs
    roll back fast from their first step, and the result reports the first run."""
    plan = plan_shards(6, "cpu,cpu", "2,4")
    policy = RollbackPolicy(mode=mode)  # type: ignore[arg-type]  # a literal of the set
    prompt = PROMPTS[0]
    single = generate(tiny, PromptLookupDrafter(), prompt, plan=plan, max_new_tokens=12,
                      block_size=4, policy=policy)
    engines: list[SpecDecoder] = []
    tests: list[CaptureGate] = []
    paths: list[str] = []
    real_init, real_test, real_commit = (
        SpecDecoder.__init__, CaptureGate.self_test, SpecDecoder._commit
    )

    def counting_init(self: SpecDecoder, *args: object, **kwargs: object) -> None:
        engines.append(self)
        real_init(self, *args, **kwargs)  # type: ignore[arg-type]

    def counting_test(self: CaptureGate, *args: object, **kwargs: object) -> bool:
        tests.append(self)
        return real_test(self, *args, **kwargs)  # type: ignore[arg-type]

    def noting_commit(self: SpecDecoder, path: str, failure: str | None) -> list[int]:
        paths.append(path)
        return real_commit(self, path, failure)

    monkeypatch.setattr(SpecDecoder, "__init__", counting_init)
    monkeypatch.setattr(CaptureGate, "self_test", counting_test)
    monkeypatch.setattr(SpecDecoder, "_commit", noting_commit)
    result = generate(tiny, PromptLookupDrafter(), prompt, plan=plan, max_new_tokens=12,
                      block_size=4, policy=policy, baseline=True, repeats=3)
    assert len(engines) == 1 and len(tests) == 1  # one engine, one self-test
    steps = single.steps
    assert paths == ["replay", *["fast"] * (3 * steps - 1)]  # only the gate's step replays
    assert result.parity is True and result.tokens == single.tokens
    assert len(result.timings.decode_runs_s) == 3
    # the reported statistics are the first run's, as one run reports them
    assert result.steps == steps and result.rollback == single.rollback
    assert result.capture == single.capture and result.capture.verdict == "validated"
    assert result.target_forwards == single.target_forwards
    assert result.avg_commit == single.avg_commit


def test_repeats_of_a_run_with_faults_get_new_engines_without_them(
    tiny: TargetModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    plan = plan_shards(6, "cpu,cpu", "2,4")
    engines: list[SpecDecoder] = []
    real_init = SpecDecoder.__init__

    def counting_init(self: SpecDecoder, *args: object, **kwargs: object) -> None:
        engines.append(self)
        real_init(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(SpecDecoder, "__init__", counting_init)
    faults = FaultInjector(phase=FaultPhase.MID_RESTORE, steps=frozenset({1}), shard=1)
    result = generate(tiny, PromptLookupDrafter(), PROMPTS[0], plan=plan, max_new_tokens=12,
                      block_size=4, policy=RollbackPolicy(mode="checkpoint"), baseline=True,
                      repeats=2, faults=faults)
    assert len(engines) == 2
    assert engines[0].faults is faults and engines[1].faults is not faults
    assert faults.fired == [(1, FaultPhase.MID_RESTORE)]  # in the first run only
    assert result.rollback.replay_after_failure == 1 and result.parity is True


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
    assert first.steps + second.steps == len(engine.records)  # each reports its own steps
    refusals: list[tuple[dict[str, object], str]] = [
        ({"target": None}, "another target"),
        ({"drafter": PromptLookupDrafter()}, "another drafter"),
        ({"block_size": 2}, "its block size is 4, not 2"),
        ({"policy": RollbackPolicy(mode="remap")}, "rollback mode is 'checkpoint', not 'remap'"),
        ({"faults": FaultInjector()}, "'faults' gets a new engine"),
        ({"engine": object()}, "must be a SpecDecoder"),
    ]
    for kw, match in refusals:
        with pytest.raises(ValueError, match=match):
            run(PROMPTS[2], **kw)
    assert run(PROMPTS[2]).rollback.replay == 0  # the refusals left the engine usable
