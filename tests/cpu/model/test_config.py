"""HybridConfig: reading HF config.json variants and rejecting bad values by name."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from dflash.model import ConfigError, HybridConfig


def _text(**over: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "model_type": "qwen3_5_text",
        "vocab_size": 128,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 8,
        "linear_value_head_dim": 8,
        "linear_conv_kernel_dim": 4,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {
            "rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.25
        },
    }
    base.update(over)
    return base


def test_layout_from_full_attention_interval() -> None:
    cfg = HybridConfig.from_hf_config(_text(full_attention_interval=2))
    assert cfg.layer_types == ("linear_attention", "full_attention") * 2
    assert cfg.recurrent_layer_ids == (0, 2) and cfg.attention_layer_ids == (1, 3)
    assert cfg.rope_theta == 1e6 and cfg.rotary_dim == 2


def test_layout_default_interval_is_four() -> None:
    cfg = HybridConfig.from_hf_config(_text())
    assert cfg.layer_types == ("linear_attention",) * 3 + ("full_attention",)


def test_layout_from_layer_types_wins() -> None:
    types = ["full_attention", "linear_attention", "linear_attention", "full_attention"]
    cfg = HybridConfig.from_hf_config(_text(layer_types=types, full_attention_interval=2))
    assert cfg.layer_types == tuple(types)


def test_qwen3_5_wrapper_reads_text_config(tmp_path: Path) -> None:
    text = _text()
    text.pop("model_type")
    wrapper = {"model_type": "qwen3_5", "text_config": text, "vision_config": {"depth": 2},
               "tie_word_embeddings": True}
    (tmp_path / "config.json").write_text(json.dumps(wrapper))
    cfg = HybridConfig.from_hf_config(tmp_path)
    assert cfg.model_type == "qwen3_5_text" and cfg.tie_word_embeddings
    assert cfg.hidden_size == 32


@pytest.mark.parametrize(("top", "inner"), [(True, False), (False, True), (True, True),
                                            (False, False)])
def test_the_wrappers_tie_flag_decides(tmp_path: Path, top: bool, inner: bool) -> None:
    """As transformers' Qwen3_5ForConditionalGeneration reads it: the top-level flag (its
    save_pretrained writes ``true`` there and leaves text_config's ``false``)."""
    text = {**_text(), "tie_word_embeddings": inner}
    text.pop("model_type")
    wrapper = {"model_type": "qwen3_5", "text_config": text, "tie_word_embeddings": top}
    (tmp_path / "config.json").write_text(json.dumps(wrapper))
    assert HybridConfig.from_hf_config(tmp_path).tie_word_embeddings is top


def test_a_rope_scaling_beside_rope_parameters_is_not_dropped() -> None:
    """transformers folds ``rope_scaling`` into the rotary: beside ``rope_parameters`` a
    scaling that changes the rotary is refused (it used to be ignored), a default one
    passes."""
    params = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25}
    for scaling in ({"rope_type": "yarn", "factor": 4.0}, {"type": "linear", "factor": 8.0}):
        with pytest.raises(ConfigError, match=r"'rope_scaling' .* beside 'rope_parameters'"):
            HybridConfig.from_hf_config(_text(rope_parameters=params, rope_scaling=scaling))
    cfg = HybridConfig.from_hf_config(_text(rope_parameters=params,
                                            rope_scaling={"rope_type": "default"}))
    assert cfg.rope_theta == 10000.0


def test_qwen3_next_dense_and_sparse_layers() -> None:
    dense = HybridConfig.from_hf_config(_text(model_type="qwen3_next", num_experts=0))
    assert dense.model_type == "qwen3_next" and dense.sparse_layer_ids == ()
    moe = HybridConfig.from_hf_config(_text(
        model_type="qwen3_next", num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
        shared_expert_intermediate_size=24, decoder_sparse_step=2, mlp_only_layers=[3],
    ))
    assert moe.sparse_layer_ids == (1,) and moe.num_experts == 8
    only_dense = _text(model_type="qwen3_next", num_experts=8, mlp_only_layers=[0, 1, 2, 3])
    assert HybridConfig.from_hf_config(only_dense).sparse_layer_ids == ()
    with pytest.raises(ConfigError, match=r"'num_experts_per_tok' must be in \[1, num_experts=8\] "
                       r"\(got 9\)"):
        HybridConfig.from_hf_config(_text(model_type="qwen3_next", num_experts=8,
                                          num_experts_per_tok=9))
    with pytest.raises(ConfigError, match=r"'decoder_sparse_step' must be a positive integer"):
        HybridConfig.from_hf_config(_text(model_type="qwen3_next", decoder_sparse_step=0))
    with pytest.raises(ConfigError, match=r"mixture-of-experts layers cannot be written"):
        moe.to_hf_config()


@pytest.mark.parametrize(
    ("over", "pattern"),
    [
        ({"model_type": "llama"}, r"'model_type' must be one of .* \(got 'llama'\)"),
        ({"num_key_value_heads": 3},
         r"'num_key_value_heads' must divide num_attention_heads=4 \(got 3\)"),
        ({"linear_num_key_heads": 3},
         r"'linear_num_key_heads' must divide linear_num_value_heads=4 \(got 3\)"),
        ({"hidden_size": 0}, r"'hidden_size': Input should be greater than 0 \(got 0\)"),
        ({"vocab_size": -5}, r"'vocab_size': Input should be greater than 0 \(got -5\)"),
        ({"linear_conv_kernel_dim": 1},
         r"'linear_conv_kernel_dim': .*greater than or equal to 2 \(got 1\)"),
        ({"rms_norm_eps": 0.0}, r"'rms_norm_eps': .*greater than 0 \(got 0.0\)"),
        ({"hidden_act": "gelu"}, r"'hidden_act' must be 'silu' \(got 'gelu'\)"),
        ({"layer_types": ["full_attention"]},
         r"'layer_types' must have num_hidden_layers=4 entries \(got 1\)"),
        ({"layer_types": ["full_attention", "x", "full_attention", "full_attention"]},
         r"'layer_types' entry 1 must be .* \(got 'x'\)"),
        ({"full_attention_interval": 0},
         r"'full_attention_interval' must be a positive integer \(got 0\)"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6}},
         r"'rope_parameters.rope_type' must be 'default' \(got 'yarn'\)"),
        ({"rope_parameters": {"rope_theta": 1e6, "partial_rotary_factor": 0.3}},
         r"'partial_rotary_factor' × head_dim must be an even integer"),
        ({"num_hidden_layers": True}, r"'num_hidden_layers' must be an integer \(got True\)"),
        ({"rope_parameters": {"rope_theta": float("inf")}}, r"'rope_theta': .*finite"),
        ({"rms_norm_eps": float("nan")}, r"'rms_norm_eps': .*finite"),
    ],
)
def test_bad_values_are_named(over: dict[str, Any], pattern: str) -> None:
    with pytest.raises(ConfigError, match=pattern):
        HybridConfig.from_hf_config(_text(**over))


def test_missing_field_and_bad_files(tmp_path: Path) -> None:
    raw = _text()
    raw.pop("linear_key_head_dim")
    with pytest.raises(ConfigError, match=r"'linear_key_head_dim' is required"):
        HybridConfig.from_hf_config(raw)
    with pytest.raises(ConfigError, match=r"cannot read config file"):
        HybridConfig.from_hf_config(tmp_path / "nope.json")
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match=r"is not valid JSON"):
        HybridConfig.from_hf_config(tmp_path)
    with pytest.raises(ConfigError, match=r"'text_config' must be an object"):
        HybridConfig.from_hf_config({"model_type": "qwen3_5"})


def test_frozen_and_named_shapes() -> None:
    cfg = HybridConfig.tiny_default()
    with pytest.raises(ValueError, match="frozen"):
        cfg.hidden_size = 3
    nine = HybridConfig.nine_b_shape()
    assert nine.num_hidden_layers == 32 and nine.attention_layer_ids == tuple(range(3, 32, 4))
    assert (nine.linear_num_value_heads, nine.linear_num_key_heads) == (32, 16)
    assert nine.conv_dim == 2 * 16 * 128 + 32 * 128


def test_transformers_defaults_match_nine_b_shape() -> None:
    transformers = pytest.importorskip("transformers")
    hf = transformers.Qwen3_5TextConfig()
    cfg = HybridConfig.from_hf_config(hf.to_dict())
    nine = HybridConfig.nine_b_shape()
    names = (
        "vocab_size", "hidden_size", "intermediate_size", "layer_types", "num_attention_heads",
        "num_key_value_heads", "head_dim", "linear_num_key_heads", "linear_num_value_heads",
        "linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim",
        "partial_rotary_factor", "tie_word_embeddings",
    )
    for name in names:
        assert getattr(cfg, name) == getattr(nine, name), name


def test_a_config_that_is_not_utf8_is_named(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_bytes(json.dumps(_text()).encode("utf-16"))
    with pytest.raises(ConfigError, match=r"config.json' is not UTF-8 text"):
        HybridConfig.from_hf_config(tmp_path)
