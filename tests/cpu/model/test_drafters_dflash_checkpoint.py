"""z-lab-format DFlash checkpoints: the exact tensor names, round trip, and all-or-nothing
loading with a typed error naming file, field or tensor for every bad-checkpoint case."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from dflash.model.drafters import (
    CheckpointConfigError,
    CheckpointFileError,
    ConfigFieldError,
    DFlashConfig,
    DFlashDrafter,
    DrafterCheckpointError,
    DrafterError,
    MaskTokenRangeError,
    MissingKeysError,
    TapLayerRangeError,
    TargetShapeMismatchError,
    TensorShapeError,
    UnexpectedKeysError,
    UnknownArchitectureError,
)

V, H, LAYERS = 32, 16, 6
CFG = DFlashConfig.for_target(
    hidden_size=H, vocab_size=V, num_target_layers=LAYERS, num_hidden_layers=2, block_size=4
)
EMBED = torch.randn(V, H, generator=torch.Generator().manual_seed(0))
HEAD = torch.randn(V, H, generator=torch.Generator().manual_seed(1))


def load(path: Path, embed: torch.Tensor = EMBED, layers: int = LAYERS) -> DFlashDrafter:
    return DFlashDrafter.from_pretrained(
        path, embed, HEAD[: embed.shape[0], : embed.shape[1]], num_target_layers=layers
    )


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    DFlashDrafter.random(CFG, EMBED, HEAD, seed=4).save_pretrained(tmp_path / "d")
    return tmp_path / "d"


def test_tensor_names_and_dtype_are_z_labs(ckpt: Path) -> None:
    tensors = load_file(str(ckpt / "model.safetensors"))
    assert {t.dtype for t in tensors.values()} == {torch.bfloat16}
    want = {"fc.weight", "hidden_norm.weight", "norm.weight"}
    for i in range(2):
        p = f"layers.{i}."
        want |= {p + "input_layernorm.weight", p + "post_attention_layernorm.weight"}
        want |= {p + f"self_attn.{n}_proj.weight" for n in "qkvo"}
        want |= {p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"}
        want |= {p + f"mlp.{n}_proj.weight" for n in ("gate", "up", "down")}
    assert set(tensors) == want
    assert tuple(tensors["fc.weight"].shape) == (H, len(CFG.target_layer_ids) * H)


def test_round_trip_keeps_weights_and_drafts(ckpt: Path) -> None:
    original = DFlashDrafter.random(CFG, EMBED, HEAD, seed=4)
    loaded = load(ckpt)
    for name, t in original.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], t.to(torch.bfloat16).float()), name
    rounded = DFlashDrafter.random(CFG, EMBED, HEAD, seed=4)
    rounded.load_state_dict(
        {k: v.to(torch.bfloat16).float() for k, v in rounded.state_dict().items()}
    )
    feats = torch.randn(7, CFG.feature_size)
    assert loaded.propose(list(range(7)), 3, 4, feats) == rounded.propose(
        list(range(7)), 3, 4, feats
    )


def edit_config(change: Callable[[dict[str, Any]], None]) -> Callable[[Path], None]:
    def apply(path: Path) -> None:
        raw = json.loads((path / "config.json").read_text())
        change(raw)
        (path / "config.json").write_text(json.dumps(raw))

    return apply


def edit_tensors(change: Callable[[dict[str, torch.Tensor]], object]) -> Callable[[Path], None]:
    def apply(path: Path) -> None:
        tensors = load_file(str(path / "model.safetensors"))
        change(tensors)
        save_file(tensors, str(path / "model.safetensors"))

    return apply


def _corrupt(path: Path) -> None:
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[: len(data) // 2])


BAD: list[tuple[str, Callable[[Path], object], type[Exception], str]] = [
    (
        "bad JSON",
        lambda p: (p / "config.json").write_text("{not json"),
        CheckpointConfigError,
        r"config\.json: not readable JSON",
    ),
    (
        "not an object",
        lambda p: (p / "config.json").write_text("[1]"),
        CheckpointConfigError,
        r"must hold a JSON object",
    ),
    (
        "no config",
        lambda p: (p / "config.json").unlink(),
        CheckpointFileError,
        r"has no config\.json",
    ),
    (
        "architecture",
        edit_config(lambda c: c.update(architectures=["LlamaForCausalLM"])),
        UnknownArchitectureError,
        r"config\.json: field 'architectures': expected \['DFlashDraftModel'\] or "
        r"\['DFlash2DraftModel'\], found \['Llama",
    ),
    (
        "model type",
        edit_config(lambda c: c.update(model_type="llama")),
        UnknownArchitectureError,
        r"field 'model_type': expected 'qwen3', found 'llama'",
    ),
    (
        "DFlash variant",
        edit_config(lambda c: c["dflash_config"].update(conv_kernel_size=2)),
        ConfigFieldError,
        r"field 'dflash_config\.conv_kernel_size'",
    ),
    (
        "missing field",
        edit_config(lambda c: c.pop("num_target_layers")),
        ConfigFieldError,
        r"field 'num_target_layers': expected an integer, found <missing>",
    ),
    (
        "missing mask id",
        edit_config(lambda c: c["dflash_config"].pop("mask_token_id")),
        ConfigFieldError,
        r"field 'dflash_config\.mask_token_id': expected a value, found <missing>",
    ),
    (
        "mask id out of vocab",
        edit_config(lambda c: c["dflash_config"].update(mask_token_id=V)),
        MaskTokenRangeError,
        rf"expected a token id in \[0, vocab_size={V}\), found {V}",
    ),
    (
        "tap out of range",
        edit_config(lambda c: c["dflash_config"].update(target_layer_ids=[1, 9])),
        CheckpointConfigError,
        r"target_layer_ids.*num_target_layers=6\) \(got 9\)",
    ),
    (
        "hidden size",
        edit_config(lambda c: c.update(hidden_size=2 * H)),
        TargetShapeMismatchError,
        rf"hidden_size is {2 * H} in the drafter config, the target has {H}",
    ),
    (
        "vocabulary",
        edit_config(lambda c: c.update(vocab_size=V + 1)),
        TargetShapeMismatchError,
        rf"vocab_size is {V + 1} in the drafter config, the target has {V}",
    ),
    (
        "target layers",
        edit_config(lambda c: c.update(num_target_layers=LAYERS + 2)),
        TargetShapeMismatchError,
        r"num_target_layers is 8 in the drafter config, the target has 6",
    ),
    (
        "string block size",
        edit_config(lambda c: c["dflash_config"].update(block_size="16")),
        ConfigFieldError,
        r"field 'block_size': expected an integer, found '16'",
    ),
    (
        "fractional window",
        edit_config(lambda c: c.update(max_position_embeddings=4096.0)),
        ConfigFieldError,
        r"field 'max_position_embeddings': expected an integer, found 4096\.0",
    ),
    (
        "infinite rope theta",
        edit_config(lambda c: c.update(rope_theta=float("inf"))),
        ConfigFieldError,
        r"field 'rope_theta': expected a finite number, found inf",
    ),
    (
        "string tap",
        edit_config(lambda c: c["dflash_config"].update(target_layer_ids=[1, "3"])),
        ConfigFieldError,
        r"field 'dflash_config\.target_layer_ids\[1\]': expected an integer layer id",
    ),
    (
        "no weights",
        lambda p: (p / "model.safetensors").unlink(),
        CheckpointFileError,
        r"has no model\.safetensors",
    ),
    ("corrupt weights", _corrupt, CheckpointFileError, r"unreadable safetensors file"),
    (
        "missing tensor",
        edit_tensors(lambda t: t.pop("layers.1.mlp.up_proj.weight")),
        MissingKeysError,
        r"missing tensors \['layers\.1\.mlp\.up_proj\.weight'\]",
    ),
    (
        "extra tensor",
        edit_tensors(lambda t: t.update({"embed_tokens.weight": torch.zeros(V, H)})),
        UnexpectedKeysError,
        r"unexpected tensors \['embed_tokens\.weight'\]",
    ),
    (
        "misshaped tensor",
        edit_tensors(lambda t: t.update({"layers.0.self_attn.k_norm.weight": torch.ones(3)})),
        TensorShapeError,
        r"'layers\.0\.self_attn\.k_norm\.weight' has shape \[3\], the config implies",
    ),
    (
        "NaN weight",
        edit_tensors(lambda t: t["fc.weight"].view(-1)[7:8].fill_(float("nan"))),
        DrafterCheckpointError,
        r"tensor 'fc\.weight' holds 1 NaN or infinite value\(s\)",
    ),
    (
        "infinite weight",
        edit_tensors(lambda t: t["norm.weight"].fill_(float("inf"))),
        DrafterCheckpointError,
        r"tensor 'norm\.weight' holds \d+ NaN or infinite",
    ),
    (
        "FP8 weight",
        edit_tensors(lambda t: t.update({"fc.weight": t["fc.weight"].to(torch.float8_e4m3fn)})),
        DrafterCheckpointError,
        r"tensor 'fc\.weight' has dtype torch\.float8_e4m3fn",
    ),
]


@pytest.mark.parametrize(("what", "damage", "error", "message"), BAD, ids=[b[0] for b in BAD])
def test_bad_checkpoints_are_refused_with_a_typed_error(
    ckpt: Path, what: str, damage: Callable[[Path], object], error: type[Exception], message: str
) -> None:
    damage(ckpt)
    with pytest.raises(error, match=message) as info:
        load(ckpt)
    assert isinstance(info.value, DrafterError), what


def test_tap_layer_outside_a_smaller_target(ckpt: Path) -> None:
    with pytest.raises(TapLayerRangeError, match=r"outside the target's layers 0\.\.2"):
        load(ckpt, layers=3)


def test_target_embedding_of_another_width(ckpt: Path) -> None:
    with pytest.raises(TargetShapeMismatchError, match=r"hidden_size is 16 .* the target has 8"):
        load(ckpt, embed=EMBED[:, :8])
