"""Grouped projections: one product for the linears that read the same input.

The parameters stay separate modules (checkpoint names unchanged) whose weights are row
blocks of one tensor. The tensor is built once per construction, load and move, never
from a product; a parameter replaced behind the model's back is noticed at the next
prefill, so a generation never multiplies stale weights.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dflash.model import TargetModel
from dflash.model.layers import DeltaNetLayer, GatedDeltaNet, LinearGroup, Ops

CPU = torch.device("cpu")
IDS = [3, 1, 4, 1, 5]


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


def test_a_linear_replaced_on_its_own_leaves_the_group_stale_until_fused() -> None:
    group, linears = _group()
    assert not group.stale
    fresh = torch.randn(3, 8)
    linears[1].load_state_dict({"weight": fresh}, assign=True)  # a new Parameter object
    assert group.stale
    group.fuse_()
    assert not group.stale and torch.equal(group.weight_and_bias()[0][5:8], fresh)
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
    with pytest.raises(ValueError, match=r"share dtype and device \(got devices \['cpu'\], "
                       r"dtypes \{'weights': \['torch.float32', 'torch.float64'\]"):
        LinearGroup(nn.Linear(8, 2), nn.Linear(8, 2, dtype=torch.float64))


def test_a_group_on_the_meta_device_is_refused_when_multiplied() -> None:
    with torch.device("meta"):
        group = LinearGroup(nn.Linear(8, 2))
    assert group.stale
    with pytest.raises(RuntimeError, match="never fused"):
        group.weight_and_bias()


def _groups(model: nn.Module) -> list[LinearGroup]:
    return [g for m in model.modules() for g in getattr(m, "linear_groups", ())]


def _fused(model: nn.Module) -> bool:
    groups = _groups(model)
    return bool(groups) and all(
        m.weight.data_ptr() == g.weight_and_bias()[0][sum(g.sizes[:i])].data_ptr()
        for g in groups
        for i, m in enumerate(g.linears)
    )


def _decode_logits(model: TargetModel) -> Tensor:
    """Logits of :data:`IDS` decoded one by one from empty caches: no prefill runs, so
    the products read the groups exactly as the last construction, load or move left them."""
    caches = model.new_caches(max_len=16)
    with torch.inference_mode():
        rows: list[Tensor] = [model(torch.tensor([[t]]), caches, "decode")[0] for t in IDS]
    return torch.cat(rows, dim=1)


def _prefill_logits(model: TargetModel) -> Tensor:
    with torch.inference_mode():
        logits: Tensor = model(torch.tensor([IDS]), model.new_caches(max_len=16), "prefill")[0]
    return logits


def _mixer(model: TargetModel) -> GatedDeltaNet:
    layer = model.layers[0]
    assert isinstance(layer, DeltaNetLayer)
    return layer.linear_attn


def _fresh(model: TargetModel, tmp_path: Path, dtype: torch.dtype) -> TargetModel:
    """A model built from ``model``'s weights by another path: written, then loaded."""
    model.save_pretrained(tmp_path / "fresh")  # views are cloned: safetensors refuses shared memory
    return TargetModel.from_pretrained(tmp_path / "fresh", dtype=dtype)


def test_models_are_fused_when_built_moved_and_loaded(tmp_path: Path) -> None:
    model = TargetModel.tiny_default(seed=1)
    assert _fused(model)
    assert len(_groups(model)) == 2 * model.config.num_hidden_layers  # mixer + MLP per layer
    fresh = _fresh(model, tmp_path, torch.float64)
    assert _fused(fresh)
    wide = model.to(torch.float64)  # a move gives every parameter new storage: fused again
    assert _fused(wide) and _groups(wide)[0].weight_and_bias()[0].dtype == torch.float64
    assert torch.equal(_decode_logits(wide), _decode_logits(fresh))
    assert torch.equal(_prefill_logits(wide), _prefill_logits(fresh))


def test_a_layer_moved_on_its_own_is_fused_again() -> None:
    model = TargetModel.tiny_default(seed=1)
    layer = model.layers[0]
    layer.to(torch.float64)  # as a ShardedTarget places its layers
    assert _fused(layer) and _groups(layer)[0].weight_and_bias()[0].dtype == torch.float64


def test_load_state_dict_with_assign_fuses_again(tmp_path: Path) -> None:
    model = TargetModel.tiny_default(seed=1)
    other = TargetModel.tiny_default(seed=2)
    fresh = _fresh(other, tmp_path, torch.float32)
    before = _decode_logits(model)
    new = {k: v.detach().clone() for k, v in other.state_dict().items()}
    model.load_state_dict(new, assign=True)  # every parameter a new tensor
    assert _fused(model)
    got = _decode_logits(model)
    assert not torch.equal(got, before)  # the new weights are read …
    assert torch.equal(got, _decode_logits(fresh))  # … exactly as a model built from them
    assert torch.equal(_prefill_logits(model), _prefill_logits(fresh))


def test_a_parameter_data_replaced_is_noticed_at_the_next_prefill(tmp_path: Path) -> None:
    model = TargetModel.tiny_default(seed=1)
    proj, group = _mixer(model).in_proj_z, _mixer(model).in_proj
    torch.manual_seed(3)
    proj.weight.data = torch.randn_like(proj.weight)  # behind the model's back
    assert group.stale
    fresh = _fresh(model, tmp_path, torch.float32)  # saved from the parameters: new weights
    assert torch.equal(_prefill_logits(model), _prefill_logits(fresh))
    assert not group.stale


def test_products_read_the_fused_weight_without_a_pointer_scan(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model = TargetModel.tiny_default(seed=1)
    want = _decode_logits(model)

    def scanned(self: LinearGroup) -> tuple[int, ...]:
        raise AssertionError("a product scanned the parameters' addresses")

    monkeypatch.setattr(LinearGroup, "_current_ptrs", scanned)
    assert torch.equal(_decode_logits(model), want)
