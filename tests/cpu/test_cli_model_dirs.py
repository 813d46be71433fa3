"""``dflash generate --model DIR`` on broken model directories: exit 2, the field named."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from dflash.cli import main
from dflash.model import ConfigError, HybridConfig

FAST = [  # the seeded tiny model (the default model is the embedded trained pair)
    "--model", "tiny", "--max-new-tokens", "4", "--block-size", "4", "--devices", "cpu",
    "--no-progress",
]


def _config(**changes: Any) -> dict[str, Any]:
    config = HybridConfig.tiny_default().to_hf_config()
    config.update(changes)
    return config


def _model_dir(tmp_path: Path, config: dict[str, Any], weights: str | None = None) -> Path:
    directory = tmp_path / "model"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(config))
    if weights is not None:
        (directory / weights).write_bytes(b"\x80\x02}q\x00.")  # a pickle's first bytes
    return directory


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("vocab_size", "512", "config field 'vocab_size': Input should be a valid integer"),
        ("hidden_size", 64.0, "config field 'hidden_size': Input should be a valid integer"),
        ("rms_norm_eps", "1e-6", "config field 'rms_norm_eps': Input should be a valid number"),
        ("attention_bias", "false", "config field 'attention_bias': Input should be a valid"),
        ("tie_word_embeddings", 0, "config field 'tie_word_embeddings': Input should be a valid"),
        ("head_dim", True, "config field 'head_dim': Input should be a valid integer"),
    ],
)
def test_config_fields_have_strict_types(
    field: str, value: object, message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        HybridConfig.from_hf_config(_config(**{field: value}))
    directory = _model_dir(tmp_path, _config(**{field: value}), "model.safetensors")
    assert main(["generate", *FAST, "--model", str(directory)]) == 2
    err = capsys.readouterr().err
    assert message in err and f"(got {value!r})" in err and "Traceback" not in err


def test_an_int_is_a_valid_float() -> None:
    rope = {"rope_type": "default", "rope_theta": 10000, "partial_rotary_factor": 0.25}
    config = HybridConfig.from_hf_config(_config(rope_parameters=rope))
    assert config.rope_theta == 10000.0


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (
            {"num_key_value_heads": 3},
            "config field 'num_key_value_heads' must divide num_attention_heads=4 (got 3)",
        ),
        (
            {"linear_num_key_heads": 3},
            "config field 'linear_num_key_heads' must divide linear_num_value_heads=4 (got 3)",
        ),
    ],
)
def test_cross_field_rules_name_the_field(
    changes: dict[str, Any], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    directory = _model_dir(tmp_path, _config(**changes), "model.safetensors")
    assert main(["generate", *FAST, "--model", str(directory)]) == 2
    err = capsys.readouterr().err
    assert message in err and "'config'" not in err and "Value error" not in err


@pytest.mark.parametrize("weights", ["pytorch_model.bin", "model.pt", "consolidated.pth"])
def test_pickle_only_directory_says_why_and_how_to_convert(
    weights: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    directory = _model_dir(tmp_path, _config(), weights)
    assert main(["generate", *FAST, "--model", str(directory)]) == 2
    err = capsys.readouterr().err
    assert f"holds only pickle weights ({weights})" in err
    assert "refuses pickle on purpose" in err and "arbitrary code" in err
    assert "save_pretrained" in err and "safe_serialization=True" in err
    assert (directory / weights).read_bytes() == b"\x80\x02}q\x00."  # never opened or changed


def test_a_directory_without_any_weights_still_says_what_is_expected(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    directory = _model_dir(tmp_path, _config())
    assert main(["generate", *FAST, "--model", str(directory)]) == 2
    assert "expected 'model.safetensors' or 'model.safetensors.index.json'" in (
        capsys.readouterr().err
    )
