"""The embedded default pair and the model / drafter names that resolve to it.

Part 1 runs on the shipped package data (``dflash/data/default``, or ``$DFLASH_DATA_DIR``)
and skips, saying why, when it is not installed: transformers' ``Qwen3_5ForCausalLM`` and
dflash load the same target and agree on the logits; the tokenizer round-trips Python; the
drafter loads and decoding with it is lossless; the sizes stay within the package limits.

Part 2 checks the name resolution of ``dflash.execution.session`` against a stand-in pair
written to a temporary directory (never into the package).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TypedDict, cast

import pytest
import torch

from dflash.data import ENV_VAR, DefaultDataMissingError, missing_files, require_default
from dflash.execution import ShardPlan, session
from dflash.execution.session import SessionError
from dflash.model import HybridConfig, TargetModel
from dflash.model.drafters import DFlashDrafter
from dflash.model.tokenizer import eos_token_id, load_tokenizer

PY_TEXT = (
    "import os\n\n\ndef walk(top):\n    for root, dirs, files in os.walk(top):\n"
    "        for name in files:\n            yield os.path.join(root, name)\n"
)
STEPS = 16
TOL = 1e-3  # float32 on both sides; trained logits are O(10)


def _shipped() -> tuple[Path, Path]:
    missing = {part: missing_files(part) for part in ("target", "drafter")}
    if any(missing.values()):
        pytest.skip(f"the default pair is not installed ({missing}); see scripts/build_default.py")
    return require_default("target"), require_default("drafter")


# -- part 1: the shipped pair -------------------------------------------------------------


def test_shipped_sizes_within_limits() -> None:
    target, drafter = _shipped()
    files = [p for d in (target, drafter) for p in d.iterdir() if p.is_file()]
    assert all(p.stat().st_size <= 16 * 2**20 for p in files), files
    assert sum(p.stat().st_size for p in files) <= 24 * 2**20


def test_shipped_tokenizer_round_trips_python_and_names_eos() -> None:
    target, _ = _shipped()
    tok = load_tokenizer(target)
    assert tok is not None
    for text in (PY_TEXT, "class A:\n\tpass  # ✓ naïve\n", ""):
        assert tok.decode(tok.encode(text)) == text
    assert len(tok.encode(PY_TEXT)) < len(PY_TEXT) / 2  # a code vocabulary, not bytes
    eos = eos_token_id(target)
    assert eos is not None and eos == tok.token_id("<|endoftext|>")
    config = json.loads((target / "config.json").read_text(encoding="utf-8"))
    assert tok.vocab_size == config["vocab_size"]


@pytest.mark.slow
@torch.inference_mode()
def test_shipped_target_logits_match_transformers() -> None:
    transformers = pytest.importorskip("transformers")
    target, _ = _shipped()
    tok = load_tokenizer(target)
    assert tok is not None
    prompt = tok.encode(PY_TEXT)
    hf = transformers.Qwen3_5ForCausalLM.from_pretrained(str(target), dtype=torch.float32)
    hf.config._attn_implementation = "eager"
    hf.eval()
    ours = TargetModel.from_pretrained(target, dtype=torch.float32, device="cpu")
    assert ours.config.layer_types.count("full_attention") >= 1  # a hybrid, as Qwen3.5
    assert ours.config.layer_types.count("linear_attention") >= 1
    out = hf(input_ids=torch.tensor([prompt]), use_cache=True)
    ref, tokens = [out.logits[0, -1]], []
    for _ in range(STEPS):
        tokens.append(int(ref[-1].argmax()))
        out = hf(input_ids=torch.tensor([[tokens[-1]]]), cache=out.cache, use_cache=True)
        ref.append(out.logits[0, -1])
    caches = ours.new_caches(max_len=len(prompt) + STEPS + 1)
    got, _ = ours(torch.tensor([prompt]), caches, "prefill")
    diffs = [float((got[0, -1] - ref[0]).abs().max())]
    for step, tok_id in enumerate(tokens):
        got, _ = ours(torch.tensor([[tok_id]]), caches, "decode")
        diffs.append(float((got[0, -1] - ref[step + 1]).abs().max()))
    assert max(diffs) <= TOL, f"logits differ by up to {max(diffs)}"


@pytest.mark.slow
def test_shipped_pair_decodes_losslessly_through_the_session() -> None:
    from dflash.execution.run import generate
    from dflash.execution.shards import plan_shards

    _shipped()
    model = session.build_model("default", seed=0, dtype=torch.float32, device="cpu")
    prompt = session.encode_prompt(
        "default", model.config.vocab_size, text=PY_TEXT, ids=None, length=None, seed=0
    )
    plan = plan_shards(model.config.num_hidden_layers, "cpu", None)
    drafter, _ = session.build_drafter(
        "dflash", model, prompt, plan=plan, acceptance=0.8, seed=0, max_new_tokens=16,
        block_size=8, model_spec="default",
    )  # fmt: skip
    result = generate(
        model, drafter, prompt, plan=plan, max_new_tokens=16, block_size=8, check_parity=True
    )
    assert result.parity is True
    assert len(result.tokens) == 16


# -- part 2: name resolution against a stand-in pair in a temporary directory --------------

_STAND_IN = HybridConfig.tiny_default().model_copy(update={"vocab_size": 300})


class BuildArgs(TypedDict):
    """session.build_drafter's keywords that these tests share."""

    plan: ShardPlan
    acceptance: float
    seed: int
    max_new_tokens: int
    block_size: int


@pytest.fixture()
def stand_in(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A seeded pair laid out like the package data, under $DFLASH_DATA_DIR = tmp_path."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from dflash.model.drafters import make_drafter

    target_dir = tmp_path / "default" / "target"
    model = TargetModel.seeded(_STAND_IN, seed=3)
    model.save_pretrained(target_dir)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        [PY_TEXT] * 3,
        trainer=trainers.BpeTrainer(
            vocab_size=299, special_tokens=["<|endoftext|>"], show_progress=False,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ),
    )  # fmt: skip
    tok.add_special_tokens(["<|mask|>"])
    tok.save(str(target_dir / "tokenizer.json"))
    (target_dir / "generation_config.json").write_text('{"eos_token_id": 0}', encoding="utf-8")
    drafter = cast(DFlashDrafter, make_drafter("dflash", model, seed=5))
    drafter.save_pretrained(tmp_path / "default" / "drafter")
    monkeypatch.setenv(ENV_VAR, str(tmp_path))
    return tmp_path


def test_default_resolves_to_the_installed_pair(stand_in: Path) -> None:
    model = session.build_model("default", seed=0, dtype=torch.float32, device="cpu")
    assert model.config == _STAND_IN
    assert session.model_config("default") == _STAND_IN
    assert session.eos_for("default") == (0,)
    tok = session.tokenizer_for("default")
    assert tok is not None and tok.path == stand_in / "default" / "target" / "tokenizer.json"
    ids = session.encode_prompt("default", 300, text=PY_TEXT, ids=None, length=None, seed=0)
    assert ids == tok.encode(PY_TEXT)


def test_draft_dflash_with_default_loads_the_shipped_drafter(stand_in: Path) -> None:
    from dflash.execution.shards import plan_shards

    model = session.build_model("default", seed=0, dtype=torch.float32, device="cpu")
    plan = plan_shards(model.config.num_hidden_layers, "cpu", None)
    kwargs: BuildArgs = dict(plan=plan, acceptance=0.8, seed=0, max_new_tokens=4, block_size=4)
    shipped, _ = session.build_drafter("dflash", model, [1, 2], model_spec="default", **kwargs)
    seeded, _ = session.build_drafter("dflash", model, [1, 2], model_spec="tiny", **kwargs)
    seed_5: BuildArgs = {**kwargs, "seed": 5}
    seeded_5, _ = session.build_drafter("dflash", model, [1, 2], **seed_5)
    # the stand-in drafter was saved (in bf16) from seed 5: loading it gives seed 5's
    # weights, not the seeded default's
    state = dict(cast(DFlashDrafter, shipped).state_dict())

    def as_saved(t: torch.Tensor) -> torch.Tensor:
        return t.to(torch.bfloat16).to(t.dtype)

    for name, value in cast(DFlashDrafter, seeded_5).state_dict().items():
        assert torch.equal(state[name], as_saved(value)), name
    assert any(
        not torch.equal(state[n], as_saved(v))
        for n, v in cast(DFlashDrafter, seeded).state_dict().items()
    )


def test_draft_dflash_with_the_default_target_directory_loads_the_shipped_drafter(
    stand_in: Path,
) -> None:
    """``--model <the installed default target's directory>`` (by any path to it) pairs with
    the shipped drafter too; a copy of that directory elsewhere is just another target."""
    import shutil

    from dflash.execution.shards import plan_shards

    model = session.build_model("default", seed=0, dtype=torch.float32, device="cpu")
    plan = plan_shards(model.config.num_hidden_layers, "cpu", None)
    kwargs: BuildArgs = dict(plan=plan, acceptance=0.8, seed=0, max_new_tokens=4, block_size=4)

    def state(model_spec: str) -> dict[str, torch.Tensor]:
        drafter, _ = session.build_drafter("dflash", model, [1, 2], model_spec=model_spec, **kwargs)
        return dict(cast(DFlashDrafter, drafter).state_dict())

    def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
        return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    shipped = state("default")
    target = stand_in / "default" / "target"
    (stand_in / "link").symlink_to(target)
    for spec in (str(target), str(stand_in / "default" / ".." / "default" / "target"),
                 str(stand_in / "link")):
        assert session.is_default_target(spec)
        assert same(state(spec), shipped), spec
    shutil.copytree(target, stand_in / "copy")
    assert not session.is_default_target(str(stand_in / "copy"))
    assert not same(state(str(stand_in / "copy")), shipped)  # a seeded drafter
    assert not session.is_default_target("tiny")
    assert not session.is_default_target(str(stand_in / "missing"))


def test_default_missing_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_VAR, str(tmp_path))
    with pytest.raises(DefaultDataMissingError, match=r"default target is not installed"):
        require_default("target")
    with pytest.raises(SessionError, match=r"'model' default: .*lacks config\.json.*--model tiny"):
        session.build_model("default", seed=0, dtype=torch.float32, device="cpu")
    with pytest.raises(SessionError, match="'model' default"):
        session.model_config("default")
    model = TargetModel.tiny_default()
    from dflash.execution.shards import plan_shards

    with pytest.raises(SessionError, match=r"'draft' dflash with 'model' default: .*drafter"):
        session.build_drafter(
            "dflash", model, [1], plan=plan_shards(6, "cpu", None), acceptance=0.8, seed=0,
            max_new_tokens=1, block_size=2, model_spec="default",
        )  # fmt: skip


def test_partly_installed_names_the_missing_file(stand_in: Path) -> None:
    (stand_in / "default" / "target" / "tokenizer.json").unlink()
    assert missing_files("target") == ["tokenizer.json"]
    with pytest.raises(SessionError, match=r"lacks tokenizer\.json"):
        session.model_config("default")
    (stand_in / "default" / "drafter" / "model.safetensors").unlink()
    assert missing_files("drafter") == ["model.safetensors"]


def test_seeded_shapes_by_name() -> None:
    assert session.model_config("tiny") == HybridConfig.tiny_default()
    assert session.model_config("nine-b-shape") == HybridConfig.nine_b_shape()
    big = session.model_config("twenty-seven-b-shape")
    assert (big.num_hidden_layers, big.hidden_size, big.intermediate_size) == (64, 5120, 17408)
    assert (big.num_attention_heads, big.num_key_value_heads, big.head_dim) == (24, 4, 256)
    assert (big.linear_num_key_heads, big.linear_num_value_heads) == (16, 48)
    assert (big.linear_key_head_dim, big.linear_value_head_dim) == (128, 128)
    assert big.attention_layer_ids == tuple(range(3, 64, 4))
    assert (big.vocab_size, big.tie_word_embeddings, big.rope_theta) == (248320, False, 1e7)
    for name in session.SEEDED_MODELS:
        assert session.model_directory(name) is None
        assert session.tokenizer_for(name) is None and session.eos_for(name) == ()


def test_unknown_model_lists_the_names(tmp_path: Path) -> None:
    with pytest.raises(SessionError, match="default, tiny, nine-b-shape, twenty-seven-b-shape"):
        session.model_config(str(tmp_path / "nope"))


def test_text_prompt_without_tokenizer(tmp_path: Path) -> None:
    with pytest.raises(SessionError, match=r"needs a tokenizer.*'bytes'"):
        session.encode_prompt(
            "tiny", 256, text="hi", ids=None, length=None, seed=0, allow_bytes=False
        )
    assert session.encode_prompt("tiny", 256, text="hi", ids=None, length=None, seed=0) == [
        104,
        105,
    ]


def test_corrupt_default_tokenizer_is_a_session_error(stand_in: Path) -> None:
    path = stand_in / "default" / "target" / "tokenizer.json"
    path.write_text("{", encoding="utf-8")
    with pytest.raises(SessionError, match=r"tokenizer\.json.* is corrupt"):
        session.tokenizer_for("default")
