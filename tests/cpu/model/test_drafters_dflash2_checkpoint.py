"""DFlash2 checkpoints (``specs/dflash2.md``) in z-lab's published layout: read and validated
whole (config and every tensor, typed errors naming file, field or tensor), written back,
and loaded as a :class:`DFlash2Drafter`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from dflash.model.drafters import (
    ConfigFieldError,
    DFlash2Config,
    DFlash2Drafter,
    DFlashConfig,
    DFlashDrafter,
    DrafterCheckpointError,
    TapLayerRangeError,
    TensorShapeError,
)
from dflash.model.drafters.dflash_checkpoint import (
    config_from_hf,
    expected_shapes,
    read_config,
    read_weights,
    write_checkpoint,
)

V, H, L, R, KC, G = 64, 32, 5, 8, 2, 16


def published_config(**dflash: Any) -> dict[str, Any]:
    """A config shaped like the published DFlash2 drafters' (small dimensions): block_size
    inside dflash_config, no num_target_layers, every layer a bidirectional window."""
    return {
        "architectures": ["DFlash2DraftModel"], "model_type": "qwen3", "hidden_act": "silu",
        "hidden_size": H, "intermediate_size": 48, "num_hidden_layers": L,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
        "vocab_size": V, "rms_norm_eps": 1e-6, "rope_theta": 10_000_000.0,
        "max_position_embeddings": 4096, "attention_bias": False, "is_causal": False,
        "layer_types": ["sliding_attention"] * L, "sliding_window": 2048,
        "use_sliding_window": True, "max_window_layers": L, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "dflash_config": {
            "mask_token_id": V - 1, "target_layer_ids": [1, 3, 5, 7, 9], "block_size": 8,
            "conv_kernel_size": KC, "conv_group_size": G, "selector_rank": R,
            "selector_top_k": 4, **dflash,
        },
    }


def tensors_for(config: DFlashConfig) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {name: torch.randn(*shape, generator=gen).to(torch.bfloat16)
            for name, shape in expected_shapes(config).items()}


def write_raw(root: Path, raw: dict[str, Any], tensors: dict[str, torch.Tensor]) -> Path:
    root.mkdir(parents=True)
    (root / "config.json").write_text(json.dumps(raw), encoding="utf-8")
    save_file(tensors, str(root / "model.safetensors"))
    return root


def test_a_published_layout_reads_whole() -> None:
    config = config_from_hf(published_config())
    assert isinstance(config, DFlash2Config)
    assert (config.block_size, config.conv_kernel_size, config.conv_group_size) == (8, KC, G)
    assert (config.selector_rank, config.selector_top_k, config.conv_groups) == (R, 4, H // G)
    assert config.is_causal is False and config.layer_window(0) == 2048
    assert not config.declares_target_depth and config.num_target_layers == 10
    assert (config.input_embedding_scale, config.output_multiplier) == (1.0, 1.0)
    assert config.final_logit_softcapping is None
    shapes = expected_shapes(config)
    assert len(shapes) == 3 + 15 * L + 3  # 81 for five layers, as the published drafters
    assert shapes["layers.0.attention_conv.base_kernel"] == (2, KC, H)
    assert shapes["layers.4.mlp_conv.kernel_projection.weight"] == (2 * KC * (H // G), H)
    assert shapes["candidate_selector.hidden_projection.weight"] == (R, H)
    assert shapes["candidate_selector.predecessor_codebook"] == (V, R)  # bare names
    assert shapes["candidate_selector.successor_codebook"] == (V, R)


def test_the_output_scalars_and_a_declared_depth() -> None:
    raw = published_config(output_multiplier=0.196, final_logit_softcapping=20.0,
                           input_embedding_scale=2.0)
    raw["num_target_layers"] = 12
    config = config_from_hf(raw)
    assert isinstance(config, DFlash2Config) and config.declares_target_depth
    assert (config.output_multiplier, config.final_logit_softcapping) == (0.196, 20.0)
    assert config.input_embedding_scale == 2.0 and config.num_target_layers == 12
    for off in (0, -1.0):  # z-lab: a cap <= 0 is no cap
        c = config_from_hf(published_config(final_logit_softcapping=off))
        assert isinstance(c, DFlash2Config) and c.final_logit_softcapping is None


def test_write_and_read_back(tmp_path: Path) -> None:
    for raw in (published_config(), {**published_config(), "num_target_layers": 12}):
        config = config_from_hf(raw)
        assert isinstance(config, DFlash2Config)
        tensors = tensors_for(config)
        root = tmp_path / str(config.num_target_layers)
        write_checkpoint(root, config, tensors)
        hf = json.loads((root / "config.json").read_text())
        assert hf["architectures"] == ["DFlash2DraftModel"] and "block_size" not in hf
        assert hf["dflash_config"]["block_size"] == 8
        assert ("num_target_layers" in hf) == config.declares_target_depth
        assert read_config(root) == config
        back = read_weights(root, expected_shapes(config))
        assert set(back) == set(tensors)
        assert all(torch.equal(back[k], tensors[k]) for k in tensors)


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        (lambda d: d.pop("conv_kernel_size"), ConfigFieldError,
         "dflash_config.conv_kernel_size"),
        (lambda d: d.pop("selector_top_k"), ConfigFieldError, "dflash_config.selector_top_k"),
        (lambda d: d.pop("block_size"), ConfigFieldError, "dflash_config.block_size"),
        (lambda d: d.pop("target_layer_ids"), ConfigFieldError,
         "dflash_config.target_layer_ids"),
        (lambda d: d.update(conv_group_size=12), DrafterCheckpointError,
         r"'conv_group_size' \(12\) must divide 'hidden_size' \(32\)"),
        (lambda d: d.update(selector_top_k=V + 1), DrafterCheckpointError,
         "'selector_top_k' must be <= vocab_size=64"),
        (lambda d: d.update(selector_rank=0), DrafterCheckpointError, "selector_rank"),
        (lambda d: d.update(conv_kernel_size=1.5), ConfigFieldError, "an integer"),
        (lambda d: d.update(output_multiplier=0.0), DrafterCheckpointError,
         "output_multiplier"),
        (lambda d: d.update(output_multiplier=float("nan")), DrafterCheckpointError,
         "output_multiplier"),
        (lambda d: d.update(input_embedding_scale="2"), ConfigFieldError, "a number"),
        (lambda d: d.update(causal=True), ConfigFieldError, "dflash_config.causal"),
    ],
)
def test_bad_dflash2_fields_are_named(change: Any, error: type[Exception], match: str) -> None:
    raw = published_config()
    change(raw["dflash_config"])
    with pytest.raises(error, match=match):
        config_from_hf(raw, "ckpt/config.json")


def test_is_causal_must_be_a_boolean() -> None:
    raw = published_config()
    raw["is_causal"] = "false"
    with pytest.raises(ConfigFieldError, match="is_causal"):
        config_from_hf(raw)


def test_v1_keeps_refusing_dflash2_keys() -> None:
    raw = published_config()
    raw["architectures"] = ["DFlashDraftModel"]
    raw["num_target_layers"] = 12
    with pytest.raises(ConfigFieldError, match=r"dflash_config\.conv_kernel_size"):
        config_from_hf(raw)


def test_a_valid_checkpoint_loads_as_a_dflash2_drafter_and_a_bad_one_not(
    tmp_path: Path,
) -> None:
    config = config_from_hf(published_config())
    tensors = tensors_for(config)
    embed, head = torch.randn(V, H), torch.randn(V, H)
    good = write_raw(tmp_path / "good", published_config(), tensors)
    drafter = DFlashDrafter.from_pretrained(good, embed, head, num_target_layers=12)
    assert isinstance(drafter, DFlash2Drafter) and drafter.label == "dflash2"
    state = drafter.state_dict()
    assert set(state) == set(tensors)
    assert all(torch.equal(state[k], tensors[k].to(state[k].dtype)) for k in tensors)
    bad = dict(tensors)
    bad["candidate_selector.successor_codebook"] = torch.zeros(V, R + 1, dtype=torch.bfloat16)
    broken = write_raw(tmp_path / "bad", published_config(), bad)
    with pytest.raises(TensorShapeError, match=r"candidate_selector\.successor_codebook"):
        DFlashDrafter.from_pretrained(broken, embed, head, num_target_layers=12)
    with pytest.raises(TapLayerRangeError, match=r"outside the target's layers 0\.\.8"):
        DFlashDrafter.from_pretrained(good, embed, head, num_target_layers=9)


def test_codebooks_saved_as_embedding_weights_read_as_their_bare_names(tmp_path: Path) -> None:
    """The reference's ``save_pretrained`` writes the selector's codebooks from their
    ``nn.Embedding`` modules, ``candidate_selector.*_codebook.weight``: they read as the
    bare names, the same tensors; a file with both spellings of one codebook is refused
    with the alias named."""
    from safetensors.torch import load_file

    from dflash.model.drafters import UnexpectedKeysError

    config = config_from_hf(published_config())
    assert isinstance(config, DFlash2Config)
    tensors = tensors_for(config)
    write_checkpoint(tmp_path, config, tensors)
    stored = load_file(str(tmp_path / "model.safetensors"))
    for name in ("predecessor_codebook", "successor_codebook"):
        stored[f"candidate_selector.{name}.weight"] = stored.pop(f"candidate_selector.{name}")
    save_file(stored, str(tmp_path / "model.safetensors"))
    back = read_weights(tmp_path, expected_shapes(config))
    assert set(back) == set(tensors) and all(torch.equal(back[k], tensors[k]) for k in tensors)
    stored["candidate_selector.successor_codebook"] = stored[
        "candidate_selector.successor_codebook.weight"].clone()
    save_file(stored, str(tmp_path / "model.safetensors"))
    with pytest.raises(UnexpectedKeysError, match=r"successor_codebook\.weight"):
        read_weights(tmp_path, expected_shapes(config))
