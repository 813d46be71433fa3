"""DFlash block drafter: shapes, bidirectionality, conditioning, seeding, save/load, errors."""

from __future__ import annotations

import json
from pathlib import Path

import pydantic
import pytest
import torch
from safetensors.torch import load_file, save_file

from dflash.model.drafters import (
    CheckpointConfigError,
    CheckpointFileError,
    DFlashConfig,
    DFlashDrafter,
    DraftArgumentError,
    DrafterCheckpointError,
    MissingKeysError,
    TargetMismatchError,
    TensorShapeError,
    UnexpectedKeysError,
    stack_tap_features,
)

V, H, N_TARGET_LAYERS = 61, 32, 6


def target_weights(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(V, H, generator=gen), torch.randn(V, H, generator=gen)


def config(**changes: object) -> DFlashConfig:
    base = DFlashConfig.for_target(H, V, N_TARGET_LAYERS)
    return base.model_copy(update=changes) if changes else base


def features(rows: int, cfg: DFlashConfig, seed: int = 1) -> torch.Tensor:
    return torch.randn(rows, cfg.feature_size, generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def drafter() -> DFlashDrafter:
    embed, lm_head = target_weights()
    return DFlashDrafter.random(config(), embed, lm_head, seed=3)


@pytest.mark.parametrize("block_size", [2, 4, 16])
def test_propose_returns_block_size_minus_one_valid_tokens(
    drafter: DFlashDrafter, block_size: int
) -> None:
    cfg = drafter.config
    context = list(range(20))
    out = drafter.propose(context, 7, block_size, features(12, cfg))
    assert len(out) == block_size - 1
    assert all(isinstance(t, int) and 0 <= t < V for t in out)
    hidden = drafter.block_hidden(torch.tensor([7] + [cfg.mask_token_id] * 3), features(5, cfg), 9)
    assert hidden.shape == (4, H)
    assert drafter.logits(hidden).shape == (4, V)


def test_proposal_is_argmax_of_mask_slot_logits(drafter: DFlashDrafter) -> None:
    cfg = drafter.config
    feats = features(8, cfg)
    block = torch.tensor([11] + [cfg.mask_token_id] * 5)
    expected = drafter.logits(drafter.block_hidden(block, feats, 10))[1:].argmax(-1).tolist()
    assert drafter.propose(list(range(10)), 11, 6, feats) == expected


def test_one_forward_per_block(drafter: DFlashDrafter) -> None:
    calls: list[int] = []
    hooks = [layer.register_forward_hook(lambda *_: calls.append(1)) for layer in drafter.layers]
    try:
        drafter.propose(list(range(10)), 3, 16, features(10, drafter.config))
    finally:
        for hook in hooks:
            hook.remove()
    assert len(calls) == drafter.config.num_layers


def test_attention_is_bidirectional_within_the_block(drafter: DFlashDrafter) -> None:
    m = drafter.config.mask_token_id
    feats = features(6, drafter.config)
    a = drafter.block_hidden(torch.tensor([4, m, m, m, m]), feats, 6)
    b = drafter.block_hidden(torch.tensor([4, m, m, m, 9]), feats, 6)  # change the last slot
    # a causal drafter would leave slots 0..3 unchanged; this one must not
    for slot in range(4):
        assert (a[slot] - b[slot]).abs().max() > 1e-4, f"slot {slot} ignores a later slot"


def test_features_condition_every_slot_and_the_proposals(drafter: DFlashDrafter) -> None:
    cfg = drafter.config
    m = cfg.mask_token_id
    block = torch.tensor([4, m, m, m])
    a = drafter.block_hidden(block, features(6, cfg, seed=1), 6)
    b = drafter.block_hidden(block, features(6, cfg, seed=2), 6)
    assert ((a - b).abs().amax(dim=-1) > 1e-4).all()
    proposals = {tuple(drafter.propose([1] * 6, 4, 8, features(6, cfg, seed=s))) for s in range(8)}
    assert len(proposals) > 1, "proposals do not depend on the features"


def test_positions_are_relative_and_separate_identical_mask_slots(
    drafter: DFlashDrafter,
) -> None:
    m = drafter.config.mask_token_id
    feats = features(4, drafter.config)
    block = torch.tensor([4, m, m, m])
    at_4 = drafter.block_hidden(block, feats, 4)
    # mask slots hold the same token; only their rotary positions tell them apart
    assert (at_4[1] - at_4[2]).abs().max() > 1e-4 and (at_4[2] - at_4[3]).abs().max() > 1e-4
    # attention sees relative positions only: shifting context and block together is a no-op
    torch.testing.assert_close(drafter.block_hidden(block, feats, 904), at_4, rtol=1e-4, atol=1e-4)


def test_context_window_uses_only_the_last_rows() -> None:
    embed, lm_head = target_weights()
    windowed = DFlashDrafter.random(config(context_window=3), embed, lm_head, seed=5)
    full = DFlashDrafter.random(config(), embed, lm_head, seed=5)
    feats = features(9, full.config)
    m = full.config.mask_token_id
    block = torch.tensor([2, m, m])
    got = windowed.block_hidden(block, feats, 9)
    want = full.block_hidden(block, feats[-3:], 9)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert not torch.equal(got, full.block_hidden(block, feats, 9))


def test_random_is_seeded_and_leaves_global_rng_alone() -> None:
    embed, lm_head = target_weights()
    state = torch.get_rng_state()
    a = DFlashDrafter.random(config(), embed, lm_head, seed=7)
    assert torch.equal(state, torch.get_rng_state())
    b = DFlashDrafter.random(config(), embed, lm_head, seed=7)
    c = DFlashDrafter.random(config(), embed, lm_head, seed=8)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["fc.weight"], sc["fc.weight"])


def test_embedding_and_lm_head_are_shared_not_copied() -> None:
    embed, lm_head = target_weights()
    d = DFlashDrafter.random(config(), embed, lm_head, seed=1)
    names = set(d.state_dict())
    assert not any("embed" in n or "lm_head" in n for n in names)
    m = d.config.mask_token_id
    block = torch.tensor([3, m, m])
    feats = features(4, d.config)
    before = d.logits(d.block_hidden(block, feats, 4))
    with torch.no_grad():
        lm_head.mul_(2.0)  # the target's tensor, changed in place
        embed[3].mul_(-1.0)
    after = d.logits(d.block_hidden(block, feats, 4))
    assert not torch.allclose(before, after)


def test_bfloat16_drafter_runs() -> None:
    embed, lm_head = target_weights()
    d = DFlashDrafter.random(config(), embed.bfloat16(), lm_head.bfloat16(), seed=1)
    assert d.dtype == torch.bfloat16
    assert len(d.propose(list(range(5)), 1, 4, features(5, d.config))) == 3


def test_empty_feature_rows_are_allowed(drafter: DFlashDrafter) -> None:
    assert len(drafter.propose([], 1, 4, features(0, drafter.config))) == 3


def test_stack_tap_features_orders_by_tap_layers() -> None:
    hidden = {layer: torch.full((1, 3, 2), float(layer)) for layer in (0, 2, 4)}
    out = stack_tap_features(hidden, (4, 0))
    assert out.shape == (3, 4)
    assert out[0].tolist() == [4.0, 4.0, 0.0, 0.0]
    with pytest.raises(DraftArgumentError, match=r"lacks tap layers \[5\]"):
        stack_tap_features(hidden, (0, 5))


# -- save / load ----------------------------------------------------------------------------


def test_save_load_round_trip_gives_identical_proposals(
    drafter: DFlashDrafter, tmp_path: Path
) -> None:
    embed, lm_head = target_weights()
    drafter.save_pretrained(tmp_path)
    loaded = DFlashDrafter.from_pretrained(tmp_path, embed, lm_head)
    assert loaded.config == drafter.config
    cfg = drafter.config
    for block_size in (2, 4, 16):
        for seed in range(3):
            feats = features(10, cfg, seed=seed)
            assert loaded.propose(list(range(10)), 5, block_size, feats) == drafter.propose(
                list(range(10)), 5, block_size, feats
            )
    sa, sb = drafter.state_dict(), loaded.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)


def _saved(tmp_path: Path) -> Path:
    embed, lm_head = target_weights()
    DFlashDrafter.random(config(), embed, lm_head, seed=2).save_pretrained(tmp_path)
    return tmp_path


def _load(path: Path) -> DFlashDrafter:
    embed, lm_head = target_weights()
    return DFlashDrafter.from_pretrained(path, embed, lm_head)


def test_load_missing_directory_and_files(tmp_path: Path) -> None:
    with pytest.raises(CheckpointFileError, match="is not a directory"):
        _load(tmp_path / "nope")
    with pytest.raises(CheckpointFileError, match=r"has no config\.json"):
        _load(tmp_path)
    (_saved(tmp_path) / "model.safetensors").unlink()
    with pytest.raises(CheckpointFileError, match=r"has no model\.safetensors"):
        _load(tmp_path)


def test_load_bad_config(tmp_path: Path) -> None:
    path = _saved(tmp_path) / "config.json"
    path.write_text("{not json")
    with pytest.raises(CheckpointConfigError, match="not readable JSON"):
        _load(tmp_path)
    raw = json.loads(config().model_dump_json())
    raw["num_kv_heads"] = 3
    path.write_text(json.dumps(raw))
    with pytest.raises(CheckpointConfigError, match=r"'num_heads' \(2\).*'num_kv_heads' \(3\)"):
        _load(tmp_path)
    raw = json.loads(config().model_dump_json())
    raw["hidden_size"] = -4
    raw["surprise"] = 1
    path.write_text(json.dumps(raw))
    with pytest.raises(CheckpointConfigError) as err:
        _load(tmp_path)
    assert "hidden_size" in str(err.value) and "-4" in str(err.value)
    assert "surprise" in str(err.value)
    raw = json.loads(config().model_dump_json())
    del raw["vocab_size"]
    path.write_text(json.dumps(raw))
    with pytest.raises(CheckpointConfigError, match=r"vocab_size: Field required$"):
        _load(tmp_path)


def test_load_config_that_disagrees_with_target(tmp_path: Path) -> None:
    path = _saved(tmp_path) / "config.json"
    raw = json.loads(path.read_text())
    raw["vocab_size"] = V + 1
    path.write_text(json.dumps(raw))
    with pytest.raises(TargetMismatchError, match=rf"'embed_weight' has shape \[{V}, {H}\]"):
        _load(tmp_path)


def _rewrite(tmp_path: Path, change: dict[str, torch.Tensor | None]) -> None:
    path = tmp_path / "model.safetensors"
    tensors = load_file(str(path))
    for key, value in change.items():
        if value is None:
            del tensors[key]
        else:
            tensors[key] = value
    save_file(tensors, str(path))


def test_load_missing_keys(tmp_path: Path) -> None:
    _rewrite(_saved(tmp_path), {"layers.1.mlp.up_proj.weight": None})
    with pytest.raises(
        MissingKeysError, match=r"missing tensors \['layers.1.mlp.up_proj.weight'\]"
    ):
        _load(tmp_path)


def test_load_unexpected_keys(tmp_path: Path) -> None:
    _rewrite(_saved(tmp_path), {"layers.9.extra.weight": torch.zeros(2)})
    with pytest.raises(
        UnexpectedKeysError, match=r"unexpected tensors \['layers.9.extra.weight'\]"
    ):
        _load(tmp_path)


def test_load_wrong_shape(tmp_path: Path) -> None:
    _rewrite(_saved(tmp_path), {"fc.weight": torch.zeros(H, 7)})
    with pytest.raises(TensorShapeError) as err:
        _load(tmp_path)
    assert err.value.key == "fc.weight"
    assert err.value.found == (H, 7) and err.value.expected == (H, 3 * H)
    assert f"'fc.weight' has shape [{H}, 7], the config implies [{H}, {3 * H}]" in str(err.value)


def test_load_integer_tensor(tmp_path: Path) -> None:
    _rewrite(_saved(tmp_path), {"norm.weight": torch.zeros(H, dtype=torch.int32)})
    with pytest.raises(DrafterCheckpointError, match=r"'norm.weight' has dtype torch.int32"):
        _load(tmp_path)


@pytest.mark.parametrize("keep", [0.5, 0.99])
def test_load_truncated_file(tmp_path: Path, keep: float) -> None:
    path = _saved(tmp_path) / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(CheckpointFileError, match="unreadable safetensors file"):
        _load(tmp_path)


def test_load_garbage_file(tmp_path: Path) -> None:
    (_saved(tmp_path) / "model.safetensors").write_bytes(b"\xff" * 64)
    with pytest.raises(CheckpointFileError, match="unreadable safetensors file"):
        _load(tmp_path)


# -- bad arguments ----------------------------------------------------------------------------


@pytest.mark.parametrize("block_size", [1, 0, -3, True, 2.0, "4"])
def test_bad_block_size(drafter: DFlashDrafter, block_size: object) -> None:
    with pytest.raises(
        DraftArgumentError, match=rf"'block_size' must be an int >= 2 \(got {block_size!r}\)"
    ):
        drafter.propose([1, 2], 1, block_size, features(2, drafter.config))  # type: ignore[arg-type]  # deliberately bad


@pytest.mark.parametrize("last", [-1, V, V + 10])
def test_bad_last_token(drafter: DFlashDrafter, last: int) -> None:
    with pytest.raises(DraftArgumentError, match=rf"'last' .*\(got {last}\)"):
        drafter.propose([1, 2], last, 4, features(2, drafter.config))


def test_bad_features(drafter: DFlashDrafter) -> None:
    width = drafter.config.feature_size
    with pytest.raises(DraftArgumentError, match=r"'features' is required .*\(got None\)"):
        drafter.propose([1, 2], 1, 4, None)
    with pytest.raises(DraftArgumentError, match=rf"shape \[T, {width}\] \(got \[2, 5\]\)"):
        drafter.propose([1, 2], 1, 4, torch.zeros(2, 5))
    with pytest.raises(DraftArgumentError, match="3 rows, more than the 2 context tokens"):
        drafter.propose([1, 2], 1, 4, torch.zeros(3, width))
    with pytest.raises(DraftArgumentError, match="must be floating point"):
        drafter.propose([1, 2], 1, 4, torch.zeros(2, width, dtype=torch.long))


def test_bad_seed_and_target_weights() -> None:
    embed, lm_head = target_weights()
    with pytest.raises(DraftArgumentError, match=r"'seed' must be an int >= 0 \(got -1\)"):
        DFlashDrafter.random(config(), embed, lm_head, seed=-1)
    with pytest.raises(TargetMismatchError, match=r"'lm_head_weight' has shape \[61, 31\]"):
        DFlashDrafter.random(config(), embed, lm_head[:, :31], seed=0)


@pytest.mark.parametrize(
    ("changes", "needle"),
    [
        ({"num_kv_heads": 3}, "'num_kv_heads' (3)"),
        ({"mask_token_id": V}, f"'mask_token_id' must be < vocab_size={V} (got {V})"),
        ({"tap_layers": (1, 1)}, "'tap_layers' must be distinct (got [1, 1])"),
        ({"tap_layers": (2, -1)}, "'tap_layers'[1] must be >= 0 (got -1)"),
        ({"tap_layers": ()}, "tap_layers"),
        ({"head_dim": 7}, "'head_dim' must be even"),
        ({"num_layers": 0}, "num_layers"),
    ],
)
def test_config_validation_names_field_and_value(changes: dict[str, object], needle: str) -> None:
    raw = json.loads(config().model_dump_json())
    raw.update(changes)
    with pytest.raises(pydantic.ValidationError) as err:
        DFlashConfig.model_validate(raw)
    assert needle in str(err.value)


def test_config_is_frozen() -> None:
    with pytest.raises(pydantic.ValidationError):
        config().hidden_size = 4
