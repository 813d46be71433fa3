"""Checkpoint loading: round trips, sharded indexes, and every error path by message."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from dflash.model import CheckpointError, HybridConfig, TargetModel, greedy_generate

PROMPT = [1, 2, 3, 4]


@pytest.fixture(scope="module")
def source() -> TargetModel:
    return TargetModel.tiny_default(seed=11)


@pytest.fixture
def ckpt(tmp_path: Path, source: TargetModel) -> Path:
    source.save_pretrained(tmp_path)
    return tmp_path


def _tensors(ckpt: Path) -> dict[str, torch.Tensor]:
    return load_file(str(ckpt / "model.safetensors"))


def _rewrite(ckpt: Path, tensors: dict[str, torch.Tensor]) -> None:
    save_file(tensors, str(ckpt / "model.safetensors"))


def _config(ckpt: Path) -> dict[str, object]:
    return json.loads((ckpt / "config.json").read_text())  # type: ignore[no-any-return]


def test_round_trip_single_file(ckpt: Path, source: TargetModel) -> None:
    loaded = TargetModel.from_pretrained(ckpt)
    for (name, a), (_, b) in zip(
        source.state_dict().items(), loaded.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), name
    assert greedy_generate(loaded, PROMPT, 8) == greedy_generate(source, PROMPT, 8)


def test_round_trip_sharded_index_and_bf16_cast(ckpt: Path, source: TargetModel) -> None:
    tensors = _tensors(ckpt)
    names = sorted(tensors)
    half = len(names) // 2
    shards = {"model-00001-of-00002.safetensors": names[:half],
              "model-00002-of-00002.safetensors": names[half:]}
    weight_map = {}
    for file, keys in shards.items():
        save_file({k: tensors[k].to(torch.bfloat16) for k in keys}, str(ckpt / file))
        weight_map.update(dict.fromkeys(keys, file))
    (ckpt / "model.safetensors").unlink()
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    loaded = TargetModel.from_pretrained(ckpt)
    assert loaded.load_report is not None and len(loaded.load_report.files) == 2
    ref = source.embed_tokens.weight.to(torch.bfloat16).float()
    assert torch.equal(loaded.embed_tokens.weight, ref)


def test_multimodal_prefix_and_ignored_heads(ckpt: Path) -> None:
    tensors = {
        (k if k.startswith("lm_head") else k.replace("model.", "model.language_model.", 1)): v
        for k, v in _tensors(ckpt).items()
    }
    tensors["mtp.fc.weight"] = torch.zeros(4, 4)
    tensors["mtp.layers.0.mlp.up_proj.weight"] = torch.zeros(4, 4)
    tensors["model.visual.patch_embed.proj.weight"] = torch.zeros(4, 4)
    _rewrite(ckpt, tensors)
    loaded = TargetModel.from_pretrained(ckpt)
    assert loaded.load_report is not None
    assert loaded.load_report.ignored == {"mtp.*": 2, "model.visual.*": 1}
    assert greedy_generate(loaded, PROMPT, 4) == greedy_generate(
        TargetModel.tiny_default(seed=11), PROMPT, 4
    )


def test_a_tied_checkpoint_storing_the_shared_matrix_as_the_head(tmp_path: Path) -> None:
    """``tie_word_embeddings`` with only ``lm_head.weight`` stored (no embedding): the one
    matrix is both, as transformers reads it; with both stored the embedding is read and
    the head is reported ignored."""
    config = HybridConfig.tiny_default().model_copy(update={"tie_word_embeddings": True})
    source = TargetModel.seeded(config, seed=3)
    source.save_pretrained(tmp_path)
    tensors = _tensors(tmp_path)
    assert "lm_head.weight" not in tensors
    tensors["lm_head.weight"] = tensors.pop("model.embed_tokens.weight")
    _rewrite(tmp_path, tensors)
    loaded = TargetModel.from_pretrained(tmp_path)
    assert torch.equal(loaded.embed_tokens.weight, source.embed_tokens.weight)
    assert loaded.lm_head.weight is loaded.embed_tokens.weight
    assert greedy_generate(loaded, PROMPT, 8) == greedy_generate(source, PROMPT, 8)
    tensors["model.embed_tokens.weight"] = tensors["lm_head.weight"].clone()
    _rewrite(tmp_path, tensors)
    both = TargetModel.from_pretrained(tmp_path)
    assert both.load_report is not None
    assert both.load_report.ignored == {"lm_head.weight (tied to embed_tokens)": 1}


def test_missing_tensor(ckpt: Path) -> None:
    tensors = _tensors(ckpt)
    del tensors["model.layers.1.linear_attn.A_log"]
    _rewrite(ckpt, tensors)
    with pytest.raises(CheckpointError, match=r"missing tensor 'layers.1.linear_attn.A_log' "
                       r"\(expected shape \[4\]; 1 missing in all\)"):
        TargetModel.from_pretrained(ckpt)


def test_unexpected_tensor(ckpt: Path) -> None:
    tensors = _tensors(ckpt)
    tensors["model.layers.2.self_attn.extra.weight"] = torch.zeros(3)
    _rewrite(ckpt, tensors)
    with pytest.raises(CheckpointError, match=r"unexpected tensor 'layers.2.self_attn.extra"):
        TargetModel.from_pretrained(ckpt)


def test_wrong_shape(ckpt: Path) -> None:
    tensors = _tensors(ckpt)
    tensors["model.layers.0.mlp.up_proj.weight"] = torch.zeros(100, 64)
    _rewrite(ckpt, tensors)
    with pytest.raises(CheckpointError, match=r"tensor 'layers.0.mlp.up_proj.weight' has shape "
                       r"\[100, 64\] but the config expects \[128, 64\]"):
        TargetModel.from_pretrained(ckpt)


def test_wrong_dtype(ckpt: Path) -> None:
    tensors = _tensors(ckpt)
    tensors["model.norm.weight"] = torch.zeros(64, dtype=torch.int32)
    _rewrite(ckpt, tensors)
    with pytest.raises(CheckpointError, match=r"tensor 'norm.weight' has dtype I32 but "
                       r"a floating dtype \(F32, BF16, F16, F64\) is expected"):
        TargetModel.from_pretrained(ckpt)


def test_non_finite_values(ckpt: Path) -> None:
    tensors = _tensors(ckpt)
    tensors["model.layers.3.linear_attn.dt_bias"][2] = float("nan")
    _rewrite(ckpt, tensors)
    with pytest.raises(CheckpointError, match=r"'layers.3.linear_attn.dt_bias' holds 1 non-finite"):
        TargetModel.from_pretrained(ckpt)


@pytest.mark.parametrize("cut", ["half", "header", "garbage"])
def test_truncated_or_corrupt_file(ckpt: Path, cut: str) -> None:
    path = ckpt / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes({"half": data[: len(data) // 2], "header": data[:5],
                      "garbage": b"\xff" * 64}[cut])
    with pytest.raises(CheckpointError, match=r"weights file 'model.safetensors' is truncated "
                       r"or corrupt"):
        TargetModel.from_pretrained(ckpt)


def test_config_with_more_layers_than_weights(ckpt: Path) -> None:
    config = _config(ckpt)
    config["num_hidden_layers"] = 4
    config["layer_types"] = config["layer_types"][:4]  # type: ignore[index]
    (ckpt / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"unexpected tensor 'layers.4\..*"
                       r"config.json has num_hidden_layers=4"):
        TargetModel.from_pretrained(ckpt)


def test_config_with_other_layout(ckpt: Path) -> None:
    config = _config(ckpt)
    config["layer_types"] = ["full_attention"] * 6
    (ckpt / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"unexpected tensor 'layers.0.linear_attn.*"
                       r"config.json says layer 0 is 'full_attention'"):
        TargetModel.from_pretrained(ckpt)


def test_config_with_other_width(ckpt: Path) -> None:
    config = _config(ckpt)
    config["intermediate_size"] = 96
    (ckpt / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"'layers.0.mlp.gate_proj.weight' has shape "
                       r"\[128, 64\] but the config expects \[96, 64\]"):
        TargetModel.from_pretrained(ckpt)


def test_config_of_other_family(ckpt: Path) -> None:
    config = _config(ckpt)
    config.update(model_type="qwen3_next", num_experts=0)
    (ckpt / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"missing tensor 'layers.0.linear_attn.in_proj_qkvz"
                       r".weight' \(qwen3_next fused projection\)"):
        TargetModel.from_pretrained(ckpt)


def test_bad_config_and_missing_files(ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    config = _config(ckpt)
    config["num_key_value_heads"] = 3
    (ckpt / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"config.json in .*'num_key_value_heads' must"):
        TargetModel.from_pretrained(ckpt)
    empty = tmp_path_factory.mktemp("empty")
    (empty / "config.json").write_text(json.dumps(HybridConfig.tiny_default().to_hf_config()))
    with pytest.raises(CheckpointError, match=r"no weights in .*expected 'model.safetensors'"):
        TargetModel.from_pretrained(empty)
    with pytest.raises(CheckpointError, match=r"checkpoint directory .* does not exist"):
        TargetModel.from_pretrained(empty / "nope")


def _index(ckpt: Path, weight_map: dict[str, str]) -> None:
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


def test_index_errors(ckpt: Path) -> None:
    names = sorted(_tensors(ckpt))
    shard = "model-00001-of-00001.safetensors"
    (ckpt / "model.safetensors").rename(ckpt / shard)  # an index is read without the file
    _index(ckpt, dict.fromkeys(names, "model-00009.safetensors"))
    with pytest.raises(CheckpointError, match=r"names shard 'model-00009.safetensors', which is "
                       r"not a file"):
        TargetModel.from_pretrained(ckpt)
    _index(ckpt, {**dict.fromkeys(names, shard), "model.extra": shard})
    with pytest.raises(CheckpointError, match=r"tensor 'model.extra' is listed in the index "
                       rf"\(shard '{shard}'\) but absent"):
        TargetModel.from_pretrained(ckpt)
    save_file({"model.norm.weight": torch.zeros(64)}, str(ckpt / "other.safetensors"))
    _index(ckpt, {**dict.fromkeys(names, shard), "x": "other.safetensors"})
    with pytest.raises(CheckpointError, match=r"tensor 'model.norm.weight' appears in both"):
        TargetModel.from_pretrained(ckpt)
    (ckpt / "model.safetensors.index.json").write_text("[1, 2]")
    with pytest.raises(CheckpointError, match=r"must hold a 'weight_map' object"):
        TargetModel.from_pretrained(ckpt)
    (ckpt / "model.safetensors.index.json").write_bytes("{}".encode("utf-16"))
    with pytest.raises(CheckpointError, match=r"is not readable JSON"):
        TargetModel.from_pretrained(ckpt)


def test_a_single_file_wins_over_an_index_beside_it(ckpt: Path) -> None:
    """As transformers reads it: ``model.safetensors`` first; an index left beside it (an
    earlier sharded save) and its shards are not read."""
    want = TargetModel.from_pretrained(ckpt)
    _index(ckpt, dict.fromkeys(sorted(_tensors(ckpt)), "model-00009.safetensors"))
    got = TargetModel.from_pretrained(ckpt)
    assert got.load_report is not None and list(got.load_report.files) == [
        "model.safetensors"]
    assert all(torch.equal(a, b) for a, b in zip(want.state_dict().values(),
                                                 got.state_dict().values(), strict=True))


# -- what a save keeps besides the weights ------------------------------------------------


def _loaded_default() -> tuple[TargetModel, Path]:
    from dflash.data import default_dir

    directory = default_dir("target")
    return TargetModel.from_pretrained(directory), directory


def test_save_keeps_the_token_ids_tokenizer_and_generation_files(tmp_path: Path) -> None:
    """A loaded model saved elsewhere (quantized, say) is still an LLM: its config names
    the same EOS, and its tokenizer and generation settings are beside it, byte for byte."""
    from dflash.model.loading import COMPANION_FILES
    from dflash.model.tokenizer import eos_token_ids, load_tokenizer

    model, source = _loaded_default()
    assert model.load_report is not None and model.load_report.directory == source
    model.quantize_fp8_().save_pretrained(tmp_path / "fp8")
    saved = tmp_path / "fp8"
    present = [name for name in COMPANION_FILES if (source / name).is_file()]
    assert {"tokenizer.json", "generation_config.json", "tokenizer_config.json"} <= set(present)
    for name in present:
        assert (saved / name).read_bytes() == (source / name).read_bytes(), name
    assert _config(saved)["eos_token_id"] == json.loads((source / "config.json").read_text())[
        "eos_token_id"]
    assert eos_token_ids(saved) == eos_token_ids(source)
    # the generation file gone, config.json alone still names the EOS
    (saved / "generation_config.json").unlink()
    assert eos_token_ids(saved) == eos_token_ids(source)
    tok, tok_saved = load_tokenizer(source), load_tokenizer(saved)
    assert tok is not None and tok_saved is not None
    assert tok_saved.encode("def f(x):\n    return x") == tok.encode("def f(x):\n    return x")
    again = TargetModel.from_pretrained(saved)
    assert again.quantization is not None
    assert greedy_generate(again, PROMPT, 8) == greedy_generate(model, PROMPT, 8)


def test_save_reads_text_config_token_ids(tmp_path: Path, source: TargetModel) -> None:
    """A multimodal checkpoint names its token ids in ``text_config``; the saved text
    checkpoint names them at the top level."""
    source.save_pretrained(tmp_path / "a")
    raw = _config(tmp_path / "a")
    (tmp_path / "a" / "config.json").write_text(json.dumps(
        {"model_type": "qwen3_5", "text_config": {**raw, "eos_token_id": [7, 9],
                                                   "pad_token_id": 3},
         "bos_token_id": 5}))
    loaded = TargetModel.from_pretrained(tmp_path / "a")
    assert loaded.load_report is not None
    assert loaded.load_report.token_ids == {"bos_token_id": 5, "eos_token_id": [7, 9],
                                            "pad_token_id": 3}
    loaded.save_pretrained(tmp_path / "b")
    saved = _config(tmp_path / "b")
    assert (saved["bos_token_id"], saved["eos_token_id"], saved["pad_token_id"]) == (5, [7, 9], 3)


def test_save_without_a_source_writes_weights_and_config(tmp_path: Path,
                                                          source: TargetModel) -> None:
    source.save_pretrained(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]
    assert "eos_token_id" not in _config(tmp_path)


def test_save_refuses_when_the_source_is_gone(tmp_path: Path, source: TargetModel) -> None:
    source.save_pretrained(tmp_path / "a")
    (tmp_path / "a" / "tokenizer.json").write_text("{}")
    loaded = TargetModel.from_pretrained(tmp_path / "a")
    for path in (tmp_path / "a").iterdir():
        path.unlink()
    (tmp_path / "a").rmdir()
    gone = r"loaded from '.*/a', which no longer exists.*companions=False"
    with pytest.raises(CheckpointError, match=gone):
        loaded.save_pretrained(tmp_path / "b")
    assert not (tmp_path / "b").exists()  # refused before anything is written
    loaded.save_pretrained(tmp_path / "b", companions=False)
    assert sorted(p.name for p in (tmp_path / "b").iterdir()) == ["config.json",
                                                                  "model.safetensors"]


def test_save_over_the_loaded_directory(tmp_path: Path, source: TargetModel) -> None:
    """Saving back where it was loaded from rewrites weights and config, and leaves the
    companion files where they are."""
    source.save_pretrained(tmp_path)
    (tmp_path / "tokenizer.json").write_text('{"x": 1}')
    loaded = TargetModel.from_pretrained(tmp_path)
    loaded.quantize_fp8_().save_pretrained(tmp_path)
    assert (tmp_path / "tokenizer.json").read_text() == '{"x": 1}'
    assert TargetModel.from_pretrained(tmp_path).quantization is not None
