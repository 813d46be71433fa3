"""A ShardedTarget places the model's weights once, when it is built: every prefill only
checks (one address per parameter) that they are still where it put them, refusing with
a typed error when they moved, and fuses again the projection groups whose parameter was
replaced since (forgetting its CUDA graphs once)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from dflash.errors import ExecutionError
from dflash.execution import ShardedTarget, plan_shards
from dflash.execution.errors import WeightsMovedError
from dflash.execution.graphs import ShardGraphs, ShardOutput
from dflash.model import TargetModel
from dflash.model.layers import DeltaNetLayer

PROMPT = [5, 17, 200, 3, 5, 17]


def test_the_model_is_placed_once_per_target(monkeypatch: pytest.MonkeyPatch) -> None:
    model = TargetModel.tiny_default(seed=4)
    placed: list[ShardedTarget] = []
    real_place = ShardedTarget._place

    def counting_place(self: ShardedTarget) -> None:
        placed.append(self)
        real_place(self)

    monkeypatch.setattr(ShardedTarget, "_place", counting_place)
    target = ShardedTarget(model, plan_shards(6, "cpu,cpu", "2,4"), max_len=32, max_draft=4)
    for _ in range(3):  # three generations
        target.forward(PROMPT, "prefill", 0)
        target.forward([9], "decode", len(PROMPT))
    assert placed == [target]


def test_weights_moved_since_placement_are_refused_naming_one() -> None:
    model = TargetModel.tiny_default(seed=4)
    target = ShardedTarget(model, plan_shards(6), max_len=32, max_draft=4)
    model.to(torch.float64)
    with pytest.raises(WeightsMovedError) as info:
        target.forward(PROMPT, "prefill", 0)
    assert isinstance(info.value, ExecutionError)
    assert str(info.value).startswith(
        "parameter 'embed_tokens.weight' is torch.float64 on cpu, but this target placed it "
        "as torch.float32 on cpu"
    )
    model.to(torch.float32)  # back where the target put it: served again
    target.forward(PROMPT, "prefill", 0)


def _noted(work: Callable[[], object]) -> tuple[Callable[[], None], ShardOutput]:
    raise AssertionError("no capture runs in this test")


def test_a_parameter_data_replaced_is_fused_and_forgets_the_graphs_once() -> None:
    model = TargetModel.tiny_default(seed=4)
    target = ShardedTarget(model, plan_shards(6), max_len=32, max_draft=4)
    graphs = ShardGraphs(torch.device("cpu"), capture=_noted)  # never captures
    key = ("verify", 4, True)
    target.graphs = [graphs]
    layer = model.layers[0]
    assert isinstance(layer, DeltaNetLayer)
    mixer = layer.linear_attn
    torch.manual_seed(3)
    mixer.in_proj_z.weight.data = torch.randn_like(mixer.in_proj_z.weight)  # behind its back
    graphs._graphs[key] = object()  # type: ignore[assignment]  # a stand-in graph
    logits, _ = target.forward(PROMPT, "prefill", 0)
    assert not graphs._graphs  # the graph would read the old fused weight
    assert not mixer.in_proj.stale
    fresh = TargetModel.tiny_default(seed=4)
    fresh.load_state_dict(model.state_dict())  # in place, through the views
    want, _ = ShardedTarget(fresh, plan_shards(6), max_len=32, max_draft=4).forward(
        PROMPT, "prefill", 0
    )
    assert torch.equal(logits, want)
    graphs._graphs[key] = object()  # type: ignore[assignment]  # a stand-in, again
    target.forward(PROMPT, "prefill", 0)
    assert graphs._graphs  # nothing changed since: kept
