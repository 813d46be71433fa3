"""Grouped projections: one product for the linears that read the same input.

The parameters stay separate modules (checkpoint names unchanged) whose weights are row
blocks of one tensor; a replaced or moved parameter is noticed and fused again, so a
grouped product never multiplies stale weights.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dflash.model import TargetModel
from dflash.model.layers import LinearGroup, Ops

CPU = torch.device("cpu")


def _group(bias: bool = False) -> tuple[LinearGroup, tuple[nn.Linear, ...]]:
    torch.manual_seed(0)
    linears = (nn.Linear(8, 5, bias=bias), nn.Linear(8, 3, bias=bias), nn.Linear(8, 2, bias=bias))
    return LinearGroup(*linears), linears


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("invariant", [False, True])
def test_group_equals_the_separate_linears(bias: bool, invariant: bool) -> None:
    group, linears = _group(bias)
    x = torch.randn(1, 4, 8)
    ops = Ops(invariant=invariant, backend="reference", device=CPU, start=3 if invariant else None)
    got = ops.linear_group(group, x)
    for out, m in zip(got, linears, strict=True):
        assert out.shape == (1, 4, m.out_features)
        torch.testing.assert_close(out, F.linear(x, m.weight, m.bias), rtol=1e-6, atol=1e-6)


def test_parameters_are_rows_of_one_tensor() -> None:
    group, linears = _group(bias=True)
    weight, bias = group.weight_and_bias()
    assert weight.shape == (10, 8) and bias is not None and bias.shape == (10,)
    rows = 0
    for m in linears:
        assert m.weight.data_ptr() == weight[rows].data_ptr()
        assert m.bias is not None and m.bias.data_ptr() == bias[rows].data_ptr()
        rows += m.out_features
    with torch.no_grad():
        linears[1].weight.fill_(2.0)  # an in-place write reaches the grouped product
    assert torch.equal(group.weight_and_bias()[0][5:8], torch.full((3, 8), 2.0))


def test_a_replaced_parameter_is_fused_again() -> None:
    group, linears = _group()
    group.weight_and_bias()
    fresh = torch.randn(3, 8)
    linears[1].load_state_dict({"weight": fresh}, assign=True)  # a new Parameter object
    weight, _ = group.weight_and_bias()
    assert torch.equal(weight[5:8], fresh)
    x = torch.randn(1, 2, 8)
    got = Ops(invariant=False, backend="reference", device=CPU).linear_group(group, x)
    torch.testing.assert_close(got[1], x @ fresh.T)


def test_mismatched_linears_are_refused() -> None:
    with pytest.raises(ValueError, match="in_features"):
        LinearGroup(nn.Linear(8, 2), nn.Linear(7, 2))
    with pytest.raises(ValueError, match="bias"):
        LinearGroup(nn.Linear(8, 2), nn.Linear(8, 2, bias=False))
    with pytest.raises(ValueError, match="at least one"):
        LinearGroup()


def _groups(model: TargetModel) -> list[LinearGroup]:
    return [g for m in model.modules() for g in getattr(m, "linear_groups", ())]


def _fused(model: TargetModel) -> bool:
    groups = _groups(model)
    return bool(groups) and all(
        m.weight.data_ptr() == g.weight_and_bias()[0][sum(g.sizes[:i])].data_ptr()
        and g._ptrs == g._current_ptrs()  # the test inspects the cache itself
        for g in groups
        for i, m in enumerate(g.linears)
    )


def test_models_are_fused_when_built_moved_and_loaded(tmp_path: Path) -> None:
    model = TargetModel.tiny_default(seed=1)
    assert _fused(model)
    assert len(_groups(model)) == 2 * model.config.num_hidden_layers  # mixer + MLP per layer
    wide = model.to(torch.float64)  # a move gives every parameter new storage: fused again
    assert _fused(wide) and _groups(wide)[0].weight_and_bias()[0].dtype == torch.float64
    model.save_pretrained(tmp_path / "m")  # views are cloned: safetensors refuses shared memory
    loaded = TargetModel.from_pretrained(tmp_path / "m", dtype=torch.float64)
    assert _fused(loaded)
    ids = torch.tensor([[3, 1, 4, 1, 5]])
    want, _ = wide(ids, wide.new_caches(max_len=16), "prefill")
    got, _ = loaded(ids, loaded.new_caches(max_len=16), "prefill")
    assert torch.equal(got, want)
