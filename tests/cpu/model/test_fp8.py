"""FP8 weights (Hugging Face's fine-grained format): a model quantized at load decodes
speculatively the bits plain decoding of the same FP8 model decodes, in every rollback
mode; an FP8 checkpoint written and read back is the same weights; its logits are
transformers' on the dequantized weights; a malformed checkpoint is refused naming the
tensor or the field."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from dflash.execution import ROLLBACK_MODES, RollbackMode, RollbackPolicy, generate, plan_shards
from dflash.model import CheckpointError, TargetModel, greedy_generate
from dflash.model.drafters import PromptLookupDrafter
from dflash.model.fp8 import FP8, Fp8Linear, Fp8Spec
from dflash.model.layers import FP8_KERNEL_ROWS, LinearGroup, Ops, fuse_linear_groups_

PROMPT = [5, 17, 200, 3, 5, 17, 200, 3, 9, 40, 41, 5, 17]


@pytest.fixture(scope="module")
def fp8_tiny() -> TargetModel:
    torch.set_num_threads(1)
    return TargetModel.tiny_default(seed=2).quantize_fp8_(Fp8Spec(block=(32, 32)))


def test_the_projections_are_fp8_and_the_rest_is_not(fp8_tiny: TargetModel) -> None:
    quantized = {n for n, m in fp8_tiny.named_modules() if isinstance(m, Fp8Linear)}
    assert "layers.0.linear_attn.in_proj_qkv" in quantized
    assert "layers.2.self_attn.q_proj" in quantized and "layers.5.mlp.down_proj" in quantized
    assert len(quantized) == 4 * 5 + 2 * 4 + 6 * 3  # recurrent, attention, MLP projections
    assert fp8_tiny.lm_head.weight.dtype == torch.float32
    mixer = fp8_tiny.get_submodule("layers.0.linear_attn")
    assert mixer.get_submodule("in_proj_qkv").weight.dtype == FP8


CPU = torch.device("cpu")


def _fp8_group(model: TargetModel) -> tuple[LinearGroup, list[Fp8Linear]]:
    """Layer 0's Gated DeltaNet projections: 128, 64, 4 and 4 rows at 32-row blocks."""
    mixer = model.get_submodule("layers.0.linear_attn")
    group = getattr(mixer, "in_proj")  # noqa: B009 - typed as a module attribute
    members = [mixer.get_submodule(n) for n in ("in_proj_qkv", "in_proj_z", "in_proj_b",
                                                "in_proj_a")]
    assert all(isinstance(m, Fp8Linear) for m in members)
    return group, [m for m in members if isinstance(m, Fp8Linear)]


def test_an_fp8_group_is_one_weight_padded_to_whole_scale_blocks(fp8_tiny: TargetModel) -> None:
    group, members = _fp8_group(fp8_tiny)
    assert not group.unfused and group.fp8_block == (32, 32)
    assert group.sizes == [128, 64, 4, 4]
    assert group.offsets == [0, 128, 192, 224]   # b and a (4 rows) each padded to 32
    assert group.rows == 256
    weight, bias = group.weight_and_bias()
    scale = group.fp8_scale()
    assert bias is None and weight.dtype == FP8 and tuple(weight.shape) == (256, 64)
    assert tuple(scale.shape) == (8, 2)
    for m, lo in zip(members, group.offsets, strict=True):
        n = m.out_features
        # each member's weight and scales are views of the group's rows
        assert m.weight.data_ptr() == weight[lo].data_ptr()
        assert m.weight_scale_inv.data_ptr() == scale[lo // 32].data_ptr()
        assert tuple(m.weight_scale_inv.shape) == (-(-n // 32), 2)
    assert not weight[196:224].float().any() and not weight[228:].float().any()   # padding


@torch.inference_mode()
def test_an_fp8_group_computes_each_member_s_product(fp8_tiny: TargetModel) -> None:
    group, members = _fp8_group(fp8_tiny)
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(3))
    fused = Ops(invariant=True, backend="reference", device=CPU, start=0).linear_group(group, x)
    assert [tuple(y.shape) for y in fused] == [(5, 128), (5, 64), (5, 4), (5, 4)]
    for m, got in zip(members, fused, strict=True):
        want = F.linear(x.double(), m.dequantized(torch.float64)).float()
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # a long prefill multiplies member by member through the dequantized weights
    long = torch.randn(FP8_KERNEL_ROWS + 1, 64, generator=torch.Generator().manual_seed(4))
    prefill = Ops(invariant=False, backend="reference", device=CPU)
    for m, got in zip(members, prefill.linear_group(group, long), strict=True):
        torch.testing.assert_close(got, F.linear(long, m.dequantized(torch.float32)))


@torch.inference_mode()
def test_an_fp8_group_fuses_again_after_a_member_s_scales_are_replaced() -> None:
    model = TargetModel.tiny_default(seed=2).quantize_fp8_(Fp8Spec(block=(32, 32)))
    group, members = _fp8_group(model)
    assert not group.stale
    members[1].weight_scale_inv = members[1].weight_scale_inv * 2
    assert group.stale
    fuse_linear_groups_(model)
    assert not group.stale
    torch.testing.assert_close(group.fp8_scale()[4:6], members[1].weight_scale_inv)
    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(5))
    z = Ops(invariant=True, backend="reference", device=CPU, start=0).linear_group(group, x)[1]
    want = F.linear(x.double(), members[1].dequantized(torch.float64)).float()
    torch.testing.assert_close(z, want, rtol=1e-5, atol=1e-5)


def test_a_group_mixing_fp8_and_float_linears_is_multiplied_member_by_member() -> None:
    model = TargetModel.tiny_default(seed=2).quantize_fp8_(
        Fp8Spec(block=(32, 32), modules_to_not_convert=("layers.0.linear_attn.in_proj_a",)))
    mixer = model.get_submodule("layers.0.linear_attn")
    group = getattr(mixer, "in_proj")  # noqa: B009 - typed as a module attribute
    assert group.unfused and group.fp8_block is None and not group.stale
    assert type(mixer.get_submodule("in_proj_a")).__name__ == "Linear"
    # each member's product is its own: the FP8 members' dequantized, the float one's plain
    names = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")
    width = int(mixer.get_submodule("in_proj_a").get_parameter("weight").shape[1])
    x = torch.randn(1, 3, width, generator=torch.Generator().manual_seed(6))
    got = Ops(invariant=True, backend="reference", device=CPU, start=0).linear_group(group, x)
    assert len(got) == len(names)
    for name, y in zip(names, got, strict=True):
        member = mixer.get_submodule(name)
        w = (member.dequantized(torch.float64) if isinstance(member, Fp8Linear)
             else member.get_parameter("weight").double())
        torch.testing.assert_close(y, F.linear(x.double(), w).float(), rtol=1e-5, atol=1e-5,
                                   msg=name)


@pytest.mark.parametrize("mode", ROLLBACK_MODES)
def test_speculative_decoding_of_an_fp8_model_is_its_plain_decoding(
    fp8_tiny: TargetModel, mode: RollbackMode
) -> None:
    r = generate(fp8_tiny, PromptLookupDrafter(), PROMPT, plan=plan_shards(6, "cpu,cpu", "2,4"),
                 max_new_tokens=24, block_size=4, policy=RollbackPolicy(mode=mode),
                 check_parity=True)
    assert r.parity is True
    assert r.tokens == greedy_generate(fp8_tiny, PROMPT, 24)


def test_an_fp8_checkpoint_round_trips(fp8_tiny: TargetModel, tmp_path: Path) -> None:
    fp8_tiny.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["quantization_config"] == {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
        "weight_block_size": [32, 32],
    }
    stored = load_file(str(tmp_path / "model.safetensors"))
    assert stored["model.layers.0.mlp.up_proj.weight"].dtype == FP8
    rows = fp8_tiny.config.intermediate_size // 32
    assert stored["model.layers.0.mlp.up_proj.weight_scale_inv"].shape == (rows, 64 // 32)
    again = TargetModel.from_pretrained(tmp_path)
    assert again.quantization == Fp8Spec(block=(32, 32))
    a, b = fp8_tiny.state_dict(), again.state_dict()
    assert set(a) == set(b)
    for name in a:
        assert torch.equal(a[name].view(torch.uint8) if a[name].dtype == FP8 else a[name],
                           b[name].view(torch.uint8) if b[name].dtype == FP8 else b[name]), name
    assert greedy_generate(again, PROMPT, 12) == greedy_generate(fp8_tiny, PROMPT, 12)


def _rewrite(directory: Path, change: Any) -> None:
    path = directory / "model.safetensors"
    tensors = load_file(str(path))
    change(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


@pytest.mark.parametrize(("change", "words"), [
    (lambda t: t.pop("model.layers.1.mlp.gate_proj.weight_scale_inv"),
     "missing tensor 'layers.1.mlp.gate_proj.weight_scale_inv'"),
    (lambda t: t.__setitem__("model.layers.1.mlp.gate_proj.weight_scale_inv",
                             torch.ones(2, 2)),
     "'layers.1.mlp.gate_proj.weight_scale_inv' has shape [2, 2]"),
    (lambda t: t.__setitem__("model.layers.1.mlp.gate_proj.weight",
                             t["model.layers.1.mlp.gate_proj.weight"].float()),
     "'layers.1.mlp.gate_proj.weight' has dtype F32 but F8_E4M3 is expected"),
    # a NaN byte (0x7f / 0xff): refused, never read (the kernel's bit conversion would
    # make it +-480)
    (lambda t: t["model.layers.1.mlp.gate_proj.weight"].view(torch.uint8)[3, :2].copy_(
        torch.tensor([0x7F, 0xFF], dtype=torch.uint8)),
     "tensor 'layers.1.mlp.gate_proj.weight' holds 2 non-finite value"),
])
def test_a_malformed_fp8_checkpoint_is_refused_naming_the_tensor(
    fp8_tiny: TargetModel, tmp_path: Path, change: Any, words: str
) -> None:
    fp8_tiny.save_pretrained(tmp_path)
    _rewrite(tmp_path, change)
    with pytest.raises(CheckpointError, match=words.replace("[", r"\[").replace("]", r"\]")):
        TargetModel.from_pretrained(tmp_path)


@pytest.mark.parametrize(("field", "value", "words"), [
    ("quant_method", "awq", "field 'quant_method' must be 'fp8'"),
    ("fmt", "e5m2", "field 'fmt' must be 'e4m3'"),
    ("weight_block_size", [128], "field 'weight_block_size' must be a list of two"),
    ("activation_scheme", "static", "field 'activation_scheme' must be 'dynamic'"),
    ("activation_scheme", "STATIC", "field 'activation_scheme' must be 'dynamic'"),
    ("activation_scheme", 1, "field 'activation_scheme' must be 'dynamic'"),
    ("bits", 8, "field 'bits' is not part of the fine-grained FP8 format"),
])
def test_a_quantization_config_dflash_cannot_run_is_refused_naming_the_field(
    fp8_tiny: TargetModel, tmp_path: Path, field: str, value: object, words: str
) -> None:
    fp8_tiny.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"][field] = value
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=words):
        TargetModel.from_pretrained(tmp_path)


def test_modules_to_not_convert_stay_in_the_model_dtype(tmp_path: Path) -> None:
    model = TargetModel.tiny_default(seed=2).quantize_fp8_(
        Fp8Spec(block=(32, 32), modules_to_not_convert=("mlp", "layers.2.self_attn.o_proj"))
    )
    kinds = {n: type(m).__name__ for n, m in model.named_modules()
             if n.endswith(("mlp.up_proj", "self_attn.o_proj", "self_attn.q_proj"))}
    assert kinds["layers.0.mlp.up_proj"] == "Linear"
    assert kinds["layers.2.self_attn.o_proj"] == "Linear"
    assert kinds["layers.2.self_attn.q_proj"] == "Fp8Linear"
    model.save_pretrained(tmp_path)
    again = TargetModel.from_pretrained(tmp_path)
    assert again.quantization is not None
    # written as transformers reads it: beside other skipped modules, the bf16 LM head is
    # named (a list given, transformers converts all that it does not name)
    assert set(again.quantization.modules_to_not_convert) == {
        "mlp", "layers.2.self_attn.o_proj", "lm_head"}
    assert not again.quantization.lm_head
    assert greedy_generate(again, PROMPT, 8) == greedy_generate(model, PROMPT, 8)


@torch.inference_mode()
@pytest.mark.parametrize("lm_head", [False, True])
def test_fp8_logits_are_transformers_on_the_dequantized_weights(tmp_path: Path,
                                                                 lm_head: bool) -> None:
    """An FP8 checkpoint (written by dflash, read back; the LM head in FP8 too or not)
    against transformers running the same weights dequantized to float32: the logits of
    a prefill and 16 greedy decode steps within 1e-4, the same tokens."""
    pytest.importorskip("transformers")
    from test_parity_transformers import CASES, TOL, _hf_model
    from test_parity_transformers import PROMPT as HF_PROMPT

    kind, fields = CASES["qwen3_5_gqa_interval"]
    hf = _hf_model(kind, fields, seed=5)
    hf.save_pretrained(tmp_path / "float")
    TargetModel.from_pretrained(tmp_path / "float").quantize_fp8_(
        Fp8Spec(block=(16, 16), lm_head=lm_head)).save_pretrained(tmp_path / "fp8")
    ours = TargetModel.from_pretrained(tmp_path / "fp8")
    assert isinstance(ours.lm_head, Fp8Linear) is lm_head
    state = hf.state_dict()
    for name, module in ours.named_modules():
        if isinstance(module, Fp8Linear):
            key = "lm_head.weight" if name == "lm_head" else "model." + name + ".weight"
            state[key] = module.dequantized(torch.float32)
    hf.load_state_dict(state)
    out = hf(input_ids=torch.tensor([HF_PROMPT]), use_cache=True)
    caches = ours.new_caches(max_len=len(HF_PROMPT) + 17)
    got, _ = ours(torch.tensor([HF_PROMPT]), caches, "prefill")
    worst = float((got[0, -1] - out.logits[0, -1]).abs().max())
    for _ in range(16):
        token = int(out.logits[0, -1].argmax())
        assert int(got[0, -1].argmax()) == token
        out = hf(input_ids=torch.tensor([[token]]), cache=out.cache, use_cache=True)
        got, _ = ours(torch.tensor([[token]]), caches, "decode")
        worst = max(worst, float((got[0, -1] - out.logits[0, -1]).abs().max()))
    print(f"fp8 vs transformers on the dequantized weights: max |Δlogits| {worst:.2e}")
    assert worst <= TOL


def test_the_command_line_and_the_library_quantize_at_load(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    import dflash
    from dflash.cli import main
    from dflash.errors import UsageError

    args = ["generate", "--model", "tiny", "--max-new-tokens", "8", "--block-size", "4",
            "--devices", "cpu", "--no-progress", "--draft", "prompt-lookup", "--json"]
    assert main([*args, "--quantize", "fp8", "--check-parity", "--no-baseline"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["parity"] is True
    llm = dflash.load(model="tiny", draft="prompt-lookup", quantize="fp8")
    assert llm.model.quantization == Fp8Spec()
    assert llm.generate(PROMPT, max_new_tokens=8).tokens == greedy_generate(llm.model, PROMPT, 8)
    with pytest.raises(UsageError, match="'quantize' must be None, 'fp8' or 'fp8-lm-head'"):
        dflash.load(model="tiny", quantize="int4")
    TargetModel.tiny_default().quantize_fp8_().save_pretrained(tmp_path)
    with pytest.raises(UsageError, match="is an FP8 checkpoint already"):
        dflash.load(model=str(tmp_path), draft=None, quantize="fp8")
    assert main([*args, "--model", str(tmp_path), "--quantize", "fp8"]) == 2
    assert "is an FP8 checkpoint already" in capsys.readouterr().err


@pytest.mark.parametrize(("skip", "name", "converts"), [
    ("mlp", "layers.0.mlp.up_proj", False),
    ("layers.2.self_attn.o_proj", "layers.2.self_attn.o_proj", False),
    ("model.layers.2.self_attn", "layers.2.self_attn.q_proj", False),
    ("layers.1", "layers.12.mlp.up_proj", True),  # whole components: 1 is not 12
    ("*.down_proj", "layers.4.mlp.down_proj", False),
    ("model.layers.4.*", "layers.4.mlp.down_proj", False),
    ("*.down_proj", "layers.4.mlp.up_proj", True),
    ("up", "layers.4.mlp.up_proj", True),  # a part of a component is not a name
    ("mlp", "lm_head", False),  # never a decoder projection (nor, by default, quantized)
])
def test_modules_to_not_convert_names(skip: str, name: str, converts: bool) -> None:
    assert Fp8Spec(modules_to_not_convert=(skip,)).converts(name) is converts


# ---------------------------------------------------------------- the LM head in FP8


@pytest.fixture(scope="module")
def fp8_head_tiny() -> TargetModel:
    torch.set_num_threads(1)
    return TargetModel.tiny_default(seed=2).quantize_fp8_(Fp8Spec(block=(32, 32),
                                                                  lm_head=True))


@pytest.mark.parametrize("mode", ["checkpoint", "recompute"])
def test_speculative_decoding_with_an_fp8_lm_head_is_its_plain_decoding(
    fp8_head_tiny: TargetModel, mode: RollbackMode
) -> None:
    assert isinstance(fp8_head_tiny.lm_head, Fp8Linear)
    assert fp8_head_tiny.lm_head.weight.dtype == FP8
    r = generate(fp8_head_tiny, PromptLookupDrafter(), PROMPT,
                 plan=plan_shards(6, "cpu,cpu", "2,4"), max_new_tokens=24, block_size=4,
                 policy=RollbackPolicy(mode=mode), check_parity=True)
    assert r.parity is True
    assert r.tokens == greedy_generate(fp8_head_tiny, PROMPT, 24)


def test_an_fp8_lm_head_round_trips(fp8_head_tiny: TargetModel, tmp_path: Path) -> None:
    """Written with an explicit, empty ``modules_to_not_convert`` (so transformers converts
    the LM head too) and the head's e4m3 weight and scales; read back by its dtype."""
    fp8_head_tiny.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["quantization_config"]["modules_to_not_convert"] == []
    stored = load_file(str(tmp_path / "model.safetensors"))
    assert stored["lm_head.weight"].dtype == FP8
    assert stored["lm_head.weight_scale_inv"].shape == (256 // 32, 64 // 32)
    again = TargetModel.from_pretrained(tmp_path)
    assert again.quantization == Fp8Spec(block=(32, 32), lm_head=True)
    assert isinstance(again.lm_head, Fp8Linear)
    assert torch.equal(again.lm_head.weight.view(torch.uint8),
                       fp8_head_tiny.lm_head.weight.view(torch.uint8))
    assert greedy_generate(again, PROMPT, 12) == greedy_generate(fp8_head_tiny, PROMPT, 12)


@torch.inference_mode()
def test_an_fp8_lm_head_computes_its_dequantized_product(fp8_head_tiny: TargetModel) -> None:
    """A decode's logits are the final hidden state times the dequantized head (float32,
    within the kernel's summation order); a prefill's too."""
    caches = fp8_head_tiny.new_caches(max_len=len(PROMPT) + 2)
    hidden: list[torch.Tensor] = []
    norm = fp8_head_tiny.norm
    handle = norm.register_forward_hook(lambda m, i, o: hidden.append(o.clone()))
    try:
        prefill, _ = fp8_head_tiny(torch.tensor([PROMPT]), caches, "prefill")
        decode, _ = fp8_head_tiny(torch.tensor([[7]]), caches, "decode")
    finally:
        handle.remove()
    head = fp8_head_tiny.lm_head
    assert isinstance(head, Fp8Linear)
    w = head.dequantized(torch.float32)
    # an invariant CPU forward normalises a 16-row position tile: the decode's row is
    # its position's within the tile
    for got, h in ((prefill[0, -1], hidden[0].reshape(-1, 64)[-1]),
                   (decode[0, -1], hidden[-1].reshape(-1, 64)[len(PROMPT) % 16])):
        torch.testing.assert_close(got, h @ w.T, rtol=1e-5, atol=1e-5)


@torch.inference_mode()
def test_a_prefill_never_dequantizes_the_fp8_lm_head(
    fp8_head_tiny: TargetModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A target's prefill takes the LM head on its last row only, through the FP8 kernel:
    the head is never dequantized whole (a 9B head would be 2 GB in bf16). A prefill
    chunk of more than ``FP8_KERNEL_ROWS`` rows dequantizes the projections it multiplies,
    once each; a short one none."""
    from dflash.execution import ShardedTarget
    from dflash.model.layers import FP8_KERNEL_ROWS

    dequantized: list[int] = []
    real = Fp8Linear.dequantized

    def recording(self: Fp8Linear, dtype: torch.dtype | None = None) -> torch.Tensor:
        dequantized.append(self.out_features)
        return real(self, dtype)

    monkeypatch.setattr(Fp8Linear, "dequantized", recording)
    vocab = fp8_head_tiny.config.vocab_size
    long_prompt = [(3 * i + 1) % vocab for i in range(FP8_KERNEL_ROWS + 20)]
    target = ShardedTarget(fp8_head_tiny, plan_shards(6, "cpu"), max_len=len(long_prompt) + 8,
                           max_draft=4, prefill_chunk=None)
    logits, _ = target.prefill(long_prompt)
    assert logits.shape[-1] == vocab and torch.isfinite(logits).all()
    projections = sum(1 for m in fp8_head_tiny.modules() if isinstance(m, Fp8Linear)) - 1
    assert vocab not in dequantized and len(dequantized) == projections
    dequantized.clear()
    short = ShardedTarget(fp8_head_tiny, plan_shards(6, "cpu"), max_len=40, max_draft=4,
                          prefill_chunk=None)
    short.prefill(PROMPT)
    assert dequantized == []


def test_a_tied_lm_head_is_not_quantized_on_its_own() -> None:
    from dflash.model import HybridConfig

    config = HybridConfig.tiny_default().model_copy(update={"tie_word_embeddings": True})
    tied = TargetModel.seeded(config, seed=1)
    with pytest.raises(ValueError, match="the LM head is tied to the embedding"):
        tied.quantize_fp8_(Fp8Spec(lm_head=True))
    assert tied.quantization is None
    tied.quantize_fp8_(Fp8Spec())   # the projections alone: fine
    assert tied.lm_head.weight is tied.embed_tokens.weight


def test_an_fp8_lm_head_that_the_config_skips_is_refused(
    fp8_head_tiny: TargetModel, tmp_path: Path
) -> None:
    fp8_head_tiny.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"]["modules_to_not_convert"] = ["lm_head"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"'lm_head\.weight' is F8_E4M3 but the "
                                              r"quantization_config's modules_to_not_convert"):
        TargetModel.from_pretrained(tmp_path)


def test_the_lm_head_from_the_command_line_and_the_library(
    capsys: pytest.CaptureFixture[str]
) -> None:
    import dflash
    from dflash.cli import main
    from dflash.commands.generate import QUANTIZE_CHOICES
    from dflash.model.fp8 import QUANTIZE_CHOICES as MODEL_CHOICES

    assert QUANTIZE_CHOICES == MODEL_CHOICES
    args = ["generate", "--model", "tiny", "--max-new-tokens", "8", "--block-size", "4",
            "--devices", "cpu", "--no-progress", "--draft", "prompt-lookup", "--json"]
    assert main([*args, "--quantize", "fp8-lm-head", "--check-parity", "--no-baseline"]) == 0
    assert json.loads(capsys.readouterr().out)["parity"] is True
    llm = dflash.load(model="tiny", draft="prompt-lookup", quantize="fp8-lm-head")
    assert llm.model.quantization == Fp8Spec(lm_head=True)
    assert isinstance(llm.model.lm_head, Fp8Linear)


def test_the_memory_estimate_counts_an_fp8_lm_head() -> None:
    """One byte per head weight plus its scales, instead of the model dtype's two."""
    from dflash.commands.resources import weight_bytes
    from dflash.model import HybridConfig

    config = HybridConfig.nine_b_shape()
    _, projections = weight_bytes(config, torch.bfloat16, Fp8Spec())
    _, with_head = weight_bytes(config, torch.bfloat16, Fp8Spec(lm_head=True))
    head = config.vocab_size * config.hidden_size
    scales = -(-config.vocab_size // 128) * (config.hidden_size // 128) * 4
    assert projections - with_head == head - scales


@pytest.mark.parametrize("draft", ["dflash", "dflash+lookup"])
def test_a_dflash_drafter_shares_an_fp8_lm_head_dequantized(
    draft: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A DFlash drafter multiplies by the target's LM head: with the head in FP8 it reads a
    dequantized copy (it used to multiply by the raw e4m3 bytes and fail); the output is
    plain decoding of the same FP8 model."""
    import dflash
    from dflash.cli import main

    args = ["generate", "--model", "tiny", "--max-new-tokens", "8", "--block-size", "4",
            "--devices", "cpu", "--no-progress", "--draft", draft, "--json"]
    assert main([*args, "--quantize", "fp8-lm-head", "--check-parity", "--no-baseline"]) == 0
    assert json.loads(capsys.readouterr().out)["parity"] is True
    llm = dflash.load(model="tiny", draft=draft, quantize="fp8-lm-head")
    head = llm.model.lm_head
    assert isinstance(head, Fp8Linear)
    assert torch.equal(llm.model.head_weight(), head.dequantized())
    plain = dflash.load(model="tiny", draft=None, quantize="fp8-lm-head")
    assert llm.generate([1, 2, 3], max_new_tokens=8).tokens == plain.generate(
        [1, 2, 3], max_new_tokens=8).tokens


def test_the_quantization_config_transformers_writes_is_read() -> None:
    """transformers' FineGrainedFP8Config writes ``dequantize``, ``modules_to_convert``,
    ``scale_fmt`` and ``expert_dtype`` beside the format's fields: read at the values
    that describe this format, refused naming the field otherwise; ``ignored_layers`` is
    its alias of the skip list; a multimodal checkpoint's ``model.language_model.*``
    names the text model's modules."""
    from dflash.model.fp8 import parse_fp8_config

    written = {"quant_method": "fp8", "modules_to_not_convert": None,
               "modules_to_convert": None, "activation_scheme": "dynamic",
               "weight_block_size": [128, 128], "dequantize": False, "scale_fmt": "float",
               "expert_dtype": "fp8"}
    assert parse_fp8_config(written, "c") == Fp8Spec()
    # the scheme in capitals, as some checkpoints spell it (transformers lowercases it)
    assert parse_fp8_config({**written, "activation_scheme": "DYNAMIC"}, "c") == Fp8Spec()
    for field, value in (("dequantize", True), ("scale_fmt", "ue8m0"),
                         ("modules_to_convert", ["layers.0.mlp.up_proj"]),
                         ("expert_dtype", "bf16")):
        with pytest.raises(CheckpointError, match=rf"field '{field}' must be"):
            parse_fp8_config({**written, field: value}, "c")
    alias = parse_fp8_config({"quant_method": "fp8", "ignored_layers": ["mlp.down_proj"]}, "c")
    assert alias is not None and not alias.converts("layers.0.mlp.down_proj")
    assert alias.converts("layers.0.mlp.up_proj")
    mm = Fp8Spec(modules_to_not_convert=("model.language_model.layers.0.linear_attn.in_proj_a",
                                         "model.language_model.layers.*.mlp.gate_proj"))
    assert not mm.converts("layers.0.linear_attn.in_proj_a")
    assert mm.converts("layers.1.linear_attn.in_proj_a")
    assert not mm.converts("layers.3.mlp.gate_proj")
