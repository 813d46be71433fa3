"""``dflash train-drafter`` on the tiny target: the loss falls, the checkpoint is z-lab's
format, loads, and decodes losslessly; ``--resume`` continues exactly where it stopped."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from dflash.cli import main
from dflash.execution import RollbackPolicy, generate, plan_shards
from dflash.model import TargetModel, greedy_generate
from dflash.model.drafters import DFlashDrafter, make_drafter
from dflash.training import TrainConfig, train_drafter

SMALL = [
    "--seq-len",
    "24",
    "--prompt-len",
    "8",
    "--block-size",
    "4",
    "--anchors",
    "6",
    "--batch-size",
    "4",
    "--teacher-samples",
    "8",
    "--eval-prompts",
    "1",
    "--eval-tokens",
    "8",
    "--device",
    "cpu",
    "--no-progress",
]


@pytest.fixture(scope="module")
def tokens(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("data") / "tokens.npy"
    rng = np.random.default_rng(0)
    np.save(path, rng.integers(0, 255, 600).astype(np.int64))
    return path


def test_train_drafter_command(tokens: Path, tmp_path: Path) -> None:
    out = tmp_path / "drafter"
    code = main(
        [
            "train-drafter",
            "--model",
            "tiny",
            "--data",
            str(tokens),
            "--out",
            str(out),
            "--steps",
            "20",
            "--lr",
            "3e-3",
            "--eval-every",
            "20",
            *SMALL,
        ]
    )
    assert code == 0
    log = json.loads((out / "train_log.json").read_text())
    losses = [loss for _, loss, _ in log["loss"]]
    assert len(losses) == 20
    assert np.mean(losses[-4:]) < np.mean(losses[:4]) - 0.1, losses
    assert [e["step"] for e in log["eval"]] == [20] and log["eval"][0]["tau"] >= 1.0
    assert log["prompt_lookup_tau"] >= 1.0
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["block_size"] == 4
    assert config["dflash_config"]["target_layer_ids"] == [3]  # z-lab's 1-layer default
    assert {t.dtype for t in load_file(str(out / "model.safetensors")).values()} == {torch.bfloat16}
    tiny = TargetModel.tiny_default(seed=0)
    drafter = make_drafter(str(out), tiny)
    assert isinstance(drafter, DFlashDrafter)
    prompt = [3, 14, 15, 92, 65, 35, 8, 9]
    result = generate(
        tiny,
        drafter,
        prompt,
        plan=plan_shards(6, "cpu", None),
        max_new_tokens=8,
        block_size=4,
        policy=RollbackPolicy(mode="checkpoint"),
    )
    assert result.tokens == greedy_generate(tiny, prompt, 8)


def test_resume_continues_exactly(tokens: Path, tmp_path: Path) -> None:
    def cfg(out: Path, resume: bool = False) -> TrainConfig:
        return TrainConfig(
            model="tiny",
            data=(str(tokens),),
            out=str(out),
            steps=8,
            batch_size=2,
            seq_len=16,
            prompt_len=4,
            block_size=4,
            anchors=4,
            teacher="data",
            teacher_samples=8,
            eval_every=8,
            save_every=5,
            eval_prompts=1,
            eval_tokens=4,
            device="cpu",
            progress=False,
            resume=resume,
        )

    straight = tmp_path / "straight"
    train_drafter(cfg(straight))
    broken = tmp_path / "broken"
    train_drafter(cfg(broken))
    shutil.rmtree(broken / "checkpoints" / "step-000008")  # as if stopped after step 5
    (broken / "model.safetensors").unlink()
    result = train_drafter(cfg(broken, resume=True))
    assert [s for s, _ in result.losses] == list(range(1, 9))
    log = json.loads((broken / "train_log.json").read_text())
    assert log["resumed_at"] == [5]  # only steps 6..8 ran again
    a = load_file(str(straight / "checkpoints" / "step-000008" / "trainer_state.safetensors"))
    b = load_file(str(broken / "checkpoints" / "step-000008" / "trainer_state.safetensors"))
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_unusable_arguments_exit_2(
    tokens: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(
        [
            "train-drafter",
            "--model",
            "tiny",
            "--data",
            str(tmp_path / "none.npy"),
            "--out",
            str(tmp_path / "o"),
            "--steps",
            "2",
            *SMALL,
        ]
    )
    assert code == 2
    assert "does not exist" in capsys.readouterr().err
    code = main(
        [
            "train-drafter",
            "--model",
            "tiny",
            "--data",
            str(tokens),
            "--out",
            str(tmp_path / "o"),
            "--steps",
            "2",
            *SMALL[:-1],
            "--resume",
        ]
    )
    assert code == 2
    assert "--resume: no checkpoint" in capsys.readouterr().err


def test_target_layers_choose_the_taps(
    tokens: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "taps"
    base = ["train-drafter", "--model", "tiny", "--data", str(tokens), "--steps", "2", *SMALL]
    assert main([*base, "--out", str(out), "--target-layers", "0,2,5"]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["dflash_config"]["target_layer_ids"] == [0, 2, 5]
    drafter = make_drafter(str(out), TargetModel.tiny_default(seed=0))
    assert isinstance(drafter, DFlashDrafter) and drafter.config.target_layer_ids == (0, 2, 5)
    capsys.readouterr()
    assert main([*base, "--out", str(tmp_path / "bad"), "--target-layers", "1,9"]) == 2
    assert "target_layer_ids" in (err := capsys.readouterr().err) and "9" in err
    with pytest.raises(SystemExit) as exc:
        main([*base, "--out", str(tmp_path / "bad"), "--target-layers", "1,x"])
    assert exc.value.code == 2
    assert "1,x" in capsys.readouterr().err


def test_heldout_loss_is_the_objective_on_heldout_sequences(tokens: Path, tmp_path: Path) -> None:
    """Each evaluation records the training objective on held-out sequences, with the
    anchors fixed across evaluations; it equals block_loss computed directly."""
    from dflash.training.data import data_set
    from dflash.training.loop import heldout_loss
    from dflash.training.objective import block_loss, sample_anchors

    out = tmp_path / "held"
    base = ["train-drafter", "--model", "tiny", "--data", str(tokens), "--out", str(out)]
    assert main([*base, "--steps", "4", "--eval-every", "2", *SMALL]) == 0
    evals = json.loads((out / "train_log.json").read_text())["eval"]
    assert [e["step"] for e in evals] == [2, 4]
    assert all(e["heldout_loss"] > 0 and 0 <= e["heldout_accuracy"] <= 1 for e in evals)
    assert evals[0]["heldout_loss"] != evals[1]["heldout_loss"]  # the drafter changed

    tiny = TargetModel.tiny_default(seed=0)
    drafter = make_drafter(str(out), tiny)
    assert isinstance(drafter, DFlashDrafter)
    stream = np.load(tokens)
    held = data_set([stream], seq_len=24, count=5, seed=3)  # 5 rows: batches of 2, 2, 1
    got = heldout_loss(tiny, drafter, held, anchors=3, gamma=2.0, batch=2, seed=11)
    gen = torch.Generator().manual_seed(11)
    total = 0.0
    for lo in (0, 2, 4):
        ids = torch.as_tensor(held.tokens[lo : lo + 2])
        picked = sample_anchors(held.label_start, 24, 4, 3, ids.shape[0], gen)
        caches = tiny.new_caches(max_len=24, max_draft=1, batch=ids.shape[0])
        taps = drafter.config.target_layer_ids
        with torch.no_grad():
            _, tapped = tiny(ids, caches, "prefill", taps=taps)
            feats = torch.cat([tapped[t] for t in taps], dim=-1)
            total += float(block_loss(drafter, ids, feats, picked, 2.0).loss) * ids.shape[0]
    assert got["heldout_loss"] == pytest.approx(total / 5, rel=1e-6)


def test_math_attention_selects_only_the_math_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    """Inside math_attention() the drafter's attention asks SDPA for the math backend only
    (a deterministic backward); outside, the fused kernels too; the setting is restored."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from dflash.model.drafters import dflash_layers

    seen: list[list[SDPBackend]] = []
    real = sdpa_kernel  # what dflash_layers imported

    def spy(backends: list[SDPBackend]) -> object:
        seen.append(list(backends))
        return real(backends)

    monkeypatch.setattr(dflash_layers, "sdpa_kernel", spy)
    tiny = TargetModel.tiny_default(seed=0)
    drafter = make_drafter("dflash", tiny)
    assert isinstance(drafter, DFlashDrafter)
    features = torch.randn(5, drafter.config.feature_size)
    drafter.propose_uncached(features, 7, drafter.config.block_size)
    assert seen and all(SDPBackend.EFFICIENT_ATTENTION in b for b in seen)
    seen.clear()
    with dflash_layers.math_attention():
        drafter.propose_uncached(features, 7, drafter.config.block_size)
    assert seen and all(b == [SDPBackend.MATH] for b in seen)
    seen.clear()
    drafter.propose_uncached(features, 7, drafter.config.block_size)
    assert seen and all(SDPBackend.EFFICIENT_ATTENTION in b for b in seen)


@pytest.mark.parametrize(("flag", "value", "words"), [
    ("--steps", "0", "--steps must be >= 1 (got 0)"),
    ("--batch-size", "0", "--batch-size must be >= 1 (got 0)"),
    ("--warmup", "-1", "--warmup must be >= 0 (got -1)"),
    ("--lr", "0", "--lr must be > 0 (got 0.0)"),
])
def test_a_bad_value_names_its_flag(
    tokens: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], flag: str, value: str,
    words: str,
) -> None:
    code = main(["train-drafter", "--model", "tiny", "--data", str(tokens), "--out",
                 str(tmp_path / "o"), *SMALL, flag, value])
    assert code == 2
    assert words in capsys.readouterr().err
