"""Training a DFlash2 drafter: each anchored block of the batched forward is the inference
forward of that block (its convolutions inside the block), the loss is the weighted
cross-entropy of the unary scores plus the selector's on the true predecessor, and
``dflash train-drafter --format dflash2`` writes a DFlash2 checkpoint that learns and
decodes losslessly."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from dflash.cli import main
from dflash.execution import RollbackPolicy, generate, plan_shards
from dflash.model import TargetModel, greedy_generate
from dflash.model.drafters import DFlash2Config, DFlash2Drafter, DFlashConfig, DFlashDrafter
from dflash.model.drafters.dflash2_drafter import DFlash2Layer
from dflash.model.drafters.dflash2_ops import unary_scores
from dflash.training import block_forward, block_loss

V, H = 23, 16


def drafter(**changes: object) -> DFlash2Drafter:
    base = DFlashConfig.for_target(hidden_size=H, vocab_size=V, num_target_layers=4,
                                   num_hidden_layers=2, block_size=4)
    cfg = DFlash2Config.model_validate({**base.model_dump(), "conv_kernel_size": 2,
                                        "conv_group_size": 4, "selector_rank": 6,
                                        "selector_top_k": 5, **changes})
    gen = torch.Generator().manual_seed(0)
    embed = torch.randn(V, H, generator=gen, dtype=torch.float64)
    head = torch.randn(V, H, generator=gen, dtype=torch.float64)
    d = DFlashDrafter.random(cfg, embed, head, seed=1, dtype=torch.float64)
    assert isinstance(d, DFlash2Drafter)
    with torch.no_grad():  # convolutions far from the identity
        for layer in d.layers:
            assert isinstance(layer, DFlash2Layer)
            for conv in (layer.attention_conv, layer.mlp_conv):
                conv.base_kernel.add_(0.5)
                conv.kernel_projection.weight.mul_(8)
    return d


def test_each_training_block_equals_the_inference_forward() -> None:
    d = drafter()
    gen = torch.Generator().manual_seed(2)
    n, s = 2, 14
    ids = torch.randint(0, V - 1, (n, s), generator=gen)
    feats = torch.randn(n, s, d.config.feature_size, generator=gen, dtype=torch.float64)
    anchors = torch.tensor([[1, 4, 9, 10], [2, 3, 6, 10]])
    hidden = block_forward(d, ids, feats, anchors).reshape(n, 4, 4, H)
    for row in range(n):
        for j, a in enumerate(anchors[row].tolist()):
            want = d.uncached_hidden(feats[row, :a], int(ids[row, a]), 4)
            torch.testing.assert_close(hidden[row, j], want, rtol=1e-9, atol=1e-9)
    with pytest.raises(ValueError, match="run blocked only"):
        block_forward(d, ids, feats, anchors, dense=True)


def test_the_loss_adds_the_selector_on_the_true_predecessor() -> None:
    d = drafter(output_multiplier=0.5, final_logit_softcapping=4.0)
    gen = torch.Generator().manual_seed(4)
    ids = torch.randint(0, V - 1, (1, 9), generator=gen)
    feats = torch.randn(1, 9, d.config.feature_size, generator=gen, dtype=torch.float64)
    got = block_loss(d, ids, feats, torch.tensor([[2, 5]]), gamma=3.0)
    hidden = block_forward(d, ids, feats, torch.tensor([[2, 5]]))[0]     # [8, H]
    logits = d.logits(hidden).float()
    unary = unary_scores(logits, 0.5, 4.0)
    sel = d.candidate_selector
    total = weight = 0.0
    for j, a in enumerate((2, 5)):
        for k in range(1, 4):
            row, label, prev = 4 * j + k, int(ids[0, a + k]), int(ids[0, a + k - 1])
            w = math.exp(-(k - 1) / 3.0)
            ce = -float(torch.log_softmax(unary[row], -1)[label])
            cands = sorted(range(V), key=lambda v: -float(logits[row, v]))[:5]
            if label not in cands:
                cands[-1] = label
            e = (hidden[row] @ sel.hidden_projection.weight.T).float()
            score = torch.stack([unary[row, c] + (sel.predecessor_codebook[prev].float() * e
                                 * sel.successor_codebook[c].float()).sum() for c in cands])
            ce += -float(torch.log_softmax(score, -1)[cands.index(label)])
            total, weight = total + w * ce, weight + w
    assert float(got.loss) == pytest.approx(total / weight, rel=1e-5)


def test_train_drafter_format_dflash2(tmp_path: Path) -> None:
    data = tmp_path / "tokens.npy"
    np.save(data, np.random.default_rng(0).integers(0, 255, 600).astype(np.int64))
    out = tmp_path / "d2"
    assert main(["train-drafter", "--model", "tiny", "--data", str(data), "--out", str(out),
                 "--format", "dflash2", "--steps", "20", "--lr", "3e-3", "--eval-every", "20",
                 "--batch-size", "4", "--seq-len", "24", "--block-size", "4", "--anchors", "4",
                 "--eval-prompts", "2", "--eval-tokens", "8", "--prompt-len", "6",
                 "--teacher", "data", "--device", "cpu", "--no-progress"]) == 0
    log = json.loads((out / "train_log.json").read_text())
    losses = [loss for _, loss, _ in log["loss"]]
    assert np.mean(losses[-4:]) < np.mean(losses[:4]) - 0.1, losses
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["DFlash2DraftModel"]
    assert config["dflash_config"]["selector_top_k"] == 16
    assert config["dflash_config"]["conv_group_size"] == 16
    tiny = TargetModel.tiny_default(seed=0)
    d = DFlashDrafter.from_pretrained(out, tiny.embed_tokens.weight, tiny.lm_head.weight,
                                      num_target_layers=6, dtype=torch.float32)
    assert isinstance(d, DFlash2Drafter)
    prompt = [3, 14, 15, 92, 65, 35, 8, 9]
    result = generate(tiny, d, prompt, plan=plan_shards(6, "cpu", None), max_new_tokens=8,
                      block_size=4, policy=RollbackPolicy(mode="checkpoint"))
    assert result.tokens == greedy_generate(tiny, prompt, 8)
